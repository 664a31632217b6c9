"""Every ```python block of README.md and docs/*.md runs, on CPU.

Conventions for the docs (the fence's info string and an optional hidden setup):

* ```python            -- run in this process, in a fresh namespace.
* ```python dist       -- needs a process group: run on 1 and on 2 gloo ranks (spawned processes on
  loopback, ``tests/dist.py``). The namespace starts with ``tp_group`` (the group of all ranks),
  ``tp`` (its size) and ``tp_rank`` (this rank), also named ``world_group``, ``world`` and ``rank``
  for setups that use the ranks for something else (pipeline stages).
* ```python signature  -- a call that spells out a public function's whole signature: it runs like
  ``python``, and every parameter of the called function must appear in the call, each keyword
  written as a literal with the function's default value.
* ```python no-run REASON -- not run (CUDA only, a trainer config, ...); the test is skipped with
  the reason.
* A block whose first line starts with ``>>>`` is a doctest: its printed output must match the
  block's text up to whitespace (output lines may be wrapped in the doc).
* ``<!-- setup: ... -->``, an HTML comment right before a block (blank lines between allowed),
  holds code run before that block, in its namespace: the variables the snippet takes as given.
  The code starts on the line after ``setup:``; the rest of that line is a free description.
  GitHub does not render the comment.

Before the setup, every namespace has ``torch`` imported and the seed set to 0, so ranks build the
same "full" tensors and cut their own shards from them. Test ids name the doc and the block's
ordinal among the doc's python blocks (``api.md:3``; ``-tp1`` / ``-tp2`` for dist blocks).

Also checked: every ``launch/...`` path, ``-m launch...`` module and relative link in the docs exists.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import inspect
import io
import itertools
import os
import pathlib
import re
import sys
import textwrap
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS = {"dist", "signature", "no-run"}

_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
_SETUP = re.compile(r"<!--\s*setup:?[^\n]*\n(?P<code>(?:(?!-->).)*)-->\s*\Z", re.S)


class Snippet:
    def __init__(self, doc: str, index: int, line: int, info: str, code: str, setup: str):
        self.doc, self.index, self.line, self.code, self.setup = doc, index, line, code, setup
        words = info.split()
        self.flags = set()
        self.reason = ""
        for i, w in enumerate(words[1:], 1):
            if w == "no-run":
                self.flags.add(w)
                self.reason = " ".join(words[i + 1:])
                break
            self.flags.add(w)
        self.doctest = code.lstrip().startswith(">>>")

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.index}"

    @property
    def where(self) -> str:
        return f"{self.doc} line {self.line}"


def snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        text = path.read_text()
        name = path.name
        index = 0
        for m in _FENCE.finditer(text):
            info = m["info"].strip()
            if info.split()[:1] != ["python"]:
                continue
            index += 1
            before = text[: m.start()]
            s = _SETUP.search(before)
            setup = textwrap.dedent(s["code"]) if s else ""
            code = textwrap.dedent(m["body"])
            found.append(Snippet(name, index, before.count("\n") + 1, info, code, setup))
    return found


SNIPPETS = snippets()


_SNIPPET_IDS = itertools.count()


def _namespace(**extra) -> dict:
    import torch

    torch.manual_seed(0)
    # the snippet's globals are a registered module's: dynamo looks a traced frame's module up by
    # its globals' __name__ (sys.modules), so a snippet that calls torch.compile needs one there;
    # one name per snippet, so no guard of an earlier snippet's compiled code reads this one's
    module = types.ModuleType(f"__doc_snippet_{next(_SNIPPET_IDS)}__")
    module.__dict__.update(torch=torch, **extra)
    sys.modules[module.__name__] = module
    return module.__dict__


def _run(setup: str, code: str, label: str, is_doctest: bool, ns: dict) -> dict:
    if setup:
        exec(compile(setup, f"<{label} setup>", "exec"), ns)
    if is_doctest:
        test = doctest.DocTestParser().get_doctest(code, ns, label, label, 0)
        out = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
        runner.run(test, out=out.write, clear_globs=False)
        if runner.failures:
            raise AssertionError(f"{label}: the printed output differs from the doc:\n{out.getvalue()}")
    else:
        exec(compile(code, f"<{label}>", "exec"), ns)
    return ns


def _on_rank(rank: int, world: int, setup: str, code: str, label: str, is_doctest: bool):
    import torch.distributed as dist

    group = dist.group.WORLD
    ns = _namespace(tp_group=group, tp=world, tp_rank=rank, world_group=group, world=world, rank=rank)
    _run(setup, code, f"{label} rank {rank}/{world}", is_doctest, ns)
    dist.barrier()
    return True


def _params():
    for s in SNIPPETS:
        marks = [pytest.mark.skip(reason=f"{s.id} not run: {s.reason}")] if "no-run" in s.flags else []
        if "dist" in s.flags:
            for world in (1, 2):
                yield pytest.param(s, world, id=f"{s.id}-tp{world}", marks=marks)
        else:
            yield pytest.param(s, 0, id=s.id, marks=marks)


@pytest.mark.parametrize("snippet,world", list(_params()))
def test_snippet(snippet: Snippet, world: int):
    label = f"{snippet.id} ({snippet.where})"
    if world:
        from tests.dist import run_ranks

        run_ranks(_on_rank, world, snippet.setup, snippet.code, label, snippet.doctest, timeout=120)
        return
    with contextlib.redirect_stdout(io.StringIO()):
        ns = _run(snippet.setup, snippet.code, label, snippet.doctest, _namespace())
    if "signature" in snippet.flags:
        _check_signature(snippet, ns)


def _check_signature(snippet: Snippet, ns: dict):
    """Every call in the block names every parameter of its function, keywords at their defaults."""
    calls = [n for n in ast.walk(ast.parse(snippet.code)) if isinstance(n, ast.Call)]
    checked = 0
    for call in calls:
        fn = eval(compile(ast.Expression(call.func), "<func>", "eval"), ns)
        if not getattr(fn, "__module__", "").startswith("vparallel_ce"):
            continue
        checked += 1
        params = inspect.signature(fn).parameters
        named = list(params)[: len(call.args)]
        for kw in call.keywords:
            assert kw.arg in params, f"{snippet.id}: {kw.arg}= is not a parameter of {fn.__qualname__}"
            value = ast.literal_eval(kw.value) if not isinstance(kw.value, ast.Attribute) else eval(
                compile(ast.Expression(kw.value), "<kw>", "eval"), ns)
            default = params[kw.arg].default
            assert default is not inspect.Parameter.empty, f"{snippet.id}: {kw.arg} has no default"
            assert value == default and type(value) is type(default), (
                f"{snippet.id}: the doc shows {fn.__qualname__}({kw.arg}={value!r}), the default is {default!r}")
            named.append(kw.arg)
        missing = [p for p, v in params.items() if p not in named and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]
        assert not missing, f"{snippet.id}: {fn.__qualname__}'s parameters {missing} are not in the doc"
    assert checked, f"{snippet.id}: a signature block without a call into vparallel_ce"


def test_every_block_follows_the_conventions():
    assert SNIPPETS, "no python blocks found"
    for s in SNIPPETS:
        unknown = s.flags - FLAGS
        assert not unknown, f"{s.where}: unknown flags {unknown} (known: {sorted(FLAGS)})"
        if "no-run" in s.flags:
            assert s.reason, f"{s.where}: `python no-run` needs a reason"
        if not s.doctest:
            compile(s.code, s.id, "exec")  # even a block that is not run must be valid Python


_LAUNCH_PATH = re.compile(r"(?<![\w/.])(launch/[\w./-]+\.(?:py|sh|sbatch|jsonl))")
_LAUNCH_MODULE = re.compile(r"-m (launch(?:\.\w+)+)")
_LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+)")


def test_commands_in_docs_name_real_paths():
    missing = []
    for path in DOCS:
        text = path.read_text()
        for m in _LAUNCH_PATH.finditer(text):
            if not (ROOT / m[1]).exists():
                missing.append(f"{path.name}: {m[1]}")
        for m in _LAUNCH_MODULE.finditer(text):
            mod = ROOT / m[1].replace(".", os.sep)
            if not (mod.with_suffix(".py").exists() or (mod / "__main__.py").exists()):
                missing.append(f"{path.name}: -m {m[1]}")
        for m in _LINK.finditer(text):
            if not (path.parent / m[1]).exists():
                missing.append(f"{path.name}: link {m[1]}")
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(dict.fromkeys(missing))
