"""The benchmarks behind the results in docs/ (one GPU unless said otherwise).

Run every module from the repository root with ``python -m`` (the package needs no install; the
library itself does: ``pip install -e .``):

===========================  =================================================================
``launch.bench.loss``        lm_head + cross-entropy fwd+bwd, ours against plain, ``torch.compile``,
                             Liger-Kernel and cut-cross-entropy (when installed), time / peak memory /
                             error: ``python -m launch.bench.loss --out loss.jsonl``
``launch.bench.report``      its markdown tables: ``python -m launch.bench.report loss.jsonl``
``launch.bench.plot``        its figures (matplotlib) into docs/img: ``python -m launch.bench.plot loss.jsonl``
``launch.bench.tp``          real tensor parallelism, correctness and per-rank cost:
                             ``torchrun --nproc_per_node 8 -m launch.bench.tp --out tp.jsonl``
``launch.bench.rl``          RL log-probs + entropy: ``python -m launch.bench.rl --out rl.jsonl``
``launch.bench.distill``     distillation, ours against compile and Liger-Kernel's fused KL / JSD:
                             ``python -m launch.bench.distill --out distill.jsonl``
``launch.bench.mtp``         multi-token prediction, ours against torchtitan's MTPLoss (plain and compiled):
                             ``python -m launch.bench.mtp --out mtp.jsonl``
``launch.bench.step``        one Llama3-8B training step per loss: ``python -m launch.bench.step --out step.jsonl``
``launch.bench.fused``       the fused GEMM kernels against cuBLAS + row passes:
                             ``python -m launch.bench.fused --set tiles --options --out fused.jsonl``
``launch.bench.ignored``     ignored-token compaction, the linear ops at ignored fractions:
                             ``python -m launch.bench.ignored --ahead-ms 0,5 --out ignored.jsonl``
``launch.bench.plan_gemms``  the lean plan's four GEMMs one by one against one cuBLAS GEMM:
                             ``python -m launch.bench.plan_gemms --shape 8192x5120x100352``
``launch.bench.timing``      the timing helper all of them share
``launch.bench.harness``     the loss benchmarks' command line and records (errors, JSON lines, the table)
===========================  =================================================================

Every module takes ``--help``, and the measuring ones (``loss``, ``tp``, ``rl``, ``distill``,
``step``, ``fused``, ``ignored``, ``mtp``, ``plan_gemms``) share two options: ``--out PATH`` appends one JSON line per measurement to
PATH, and ``--smoke`` runs tiny shapes that a CPU can do (a smoke test; its timings mean nothing).
(``plot``'s ``--out`` is the folder its figures go to.) ``results/`` holds the JSON lines the docs' tables are made from.
Before benchmarking a GPU, run the CUDA tests on it::

    pytest -q -n 8 tests/test_kernels.py tests/test_fused_linear.py tests/test_linear.py \
        tests/test_cross_entropy.py tests/test_autocast.py tests/test_logprobs.py
"""
