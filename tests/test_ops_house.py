"""The house of clgpt/ops measured: what couples its parts, each figure held at or under its ceiling, so a change
that couples them more fails here. And the copy book (clgpt/ops/copybook.py) through its own interface.

Figures (read with Python's ast, nothing run; clgpt/ops/ and its folders, gemm/):
    multi_base     classes in clgpt/ops/ with more than one base class of ours
    cross_self     calls `self.m(...)` in one clgpt/ops/ file of a method m defined only in another one
    enqueues       kernel enqueues in clgpt/ outside clgpt/ops/launcher.py (and the device probes, see ENQUEUE_OK)
    private_reach  names starting with `_` that tests reach on an ops object or engine's ops (`ops._x`,
                   `eng.ops._x`, monkeypatch.setattr(ops, "_x", ...))
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from clgpt.errors import ClgptError
from clgpt.ops.copybook import CopyBook

ROOT = Path(__file__).resolve().parent.parent
OPS_DIR = ROOT / "clgpt" / "ops"
# the ceilings: lower one when a change brings its figure down, never raise one
CEILING = dict(multi_base=0, cross_self=0, enqueues=0, private_reach=0)
# files that enqueue on a queue of their own: the device's probes where the device is made, the device tuners'
# timing harnesses (candidates timed apart from any model, before an Ops exists: the GEMM's, flash attention's, the
# row kernels'), and the profile's stand-in kernel, which the launcher itself calls
ENQUEUE_OK = {"clgpt/device/opencl.py", "clgpt/device/capabilities.py", "clgpt/device/tuner.py",
              "clgpt/device/tuner_flash.py", "clgpt/device/tuner_rows.py", "clgpt/bench.py"}


def _parsed(paths):
    return {p: ast.parse(p.read_text()) for p in paths}


def _ours(tree) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def multi_base(trees) -> list[str]:
    """Classes of clgpt/ops with more than one base that clgpt/ops defines."""
    ours = set().union(*(_ours(t) for t in trees.values()))
    out = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in ours]
                if len(bases) > 1:
                    out.append(f"{path.name}:{node.name}({', '.join(bases)})")
    return out


def _methods(tree) -> set[str]:
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(item.name)
            elif isinstance(item, ast.Assign):  # aliases: name = property(...)
                names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return names


def cross_self(trees) -> Counter:
    """(caller file, callee file) -> the calls self.m(...) from one ops file of a method only another defines."""
    defined = {p: _methods(t) for p, t in trees.items()}
    edges = Counter()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                name = node.func.attr
                if name in defined[path]:
                    continue
                owners = [p for p, names in defined.items() if name in names]
                if owners:
                    edges[(path.name, owners[0].name)] += 1
    return edges


def _queue_arg(node: ast.Call) -> bool:
    if not node.args:
        return False
    a = node.args[0]
    return (isinstance(a, ast.Name) and a.id == "queue") or (isinstance(a, ast.Attribute) and a.attr == "queue")


def enqueues(paths) -> list[str]:
    """Kernel enqueues outside the launcher: cl.enqueue_nd_range_kernel, or a kernel called on a queue (a call
    whose first argument is a queue, other than pyopencl's own copy / fill / map / marker functions)."""
    out = []
    for path in paths:
        rel = str(path.relative_to(ROOT))
        if rel in ENQUEUE_OK or rel == "clgpt/ops/launcher.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "enqueue_nd_range_kernel":
                out.append(f"{rel}:{node.lineno}")
            elif _queue_arg(node) and not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                                           and f.value.id == "cl"):
                out.append(f"{rel}:{node.lineno}")
    return out


def _is_ops(node) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("ops", "o")) or (isinstance(node, ast.Attribute)
                                                                         and node.attr == "ops")


def private_reach(paths) -> list[str]:
    """Names starting with one `_` reached on an ops object from tests."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and _is_ops(node.value) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                out.append(f"{path.name}:{node.lineno} .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                  and len(node.args) >= 2 and _is_ops(node.args[0]) and isinstance(node.args[1], ast.Constant)
                  and str(node.args[1].value).startswith("_")):
                out.append(f"{path.name}:{node.lineno} setattr {node.args[1].value}")
    return out


def measure() -> dict:
    trees = _parsed(sorted(OPS_DIR.rglob("*.py")))
    return dict(multi_base=len(multi_base(trees)), cross_self=sum(cross_self(trees).values()),
                enqueues=len(enqueues(sorted((ROOT / "clgpt").rglob("*.py")))),
                private_reach=len(private_reach(sorted((ROOT / "tests").glob("*.py")))))


def test_the_house_does_not_regress():
    figures = measure()
    print("ops house:", figures)
    over = {k: (v, CEILING[k]) for k, v in figures.items() if v > CEILING[k]}
    assert not over, f"coupling grew (figure, ceiling): {over}; see tests/test_ops_house.py's doc"


def test_the_measures_see_what_they_count(tmp_path):
    """Each measure finds the coupling it counts in a made-up file, and nothing in a clean one."""
    a = tmp_path / "a.py"
    a.write_text("class A:\n    def f(self):\n        self.g()\n        self.h()\n    def h(self):\n        pass\n"
                 "class B:\n    pass\nclass C(A, B):\n    pass\n")
    b = tmp_path / "b.py"
    b.write_text("class D:\n    def g(self):\n        kern(self.queue, (1,), None)\n")
    trees = _parsed([a, b])
    assert multi_base(trees) == ["a.py:C(A, B)"]
    assert cross_self(trees) == Counter({("a.py", "b.py"): 1})
    t = tmp_path / "t.py"
    t.write_text("ops._kept\neng.ops._mm\nops.run\nmonkeypatch.setattr(ops, '_launch', 1)\n")
    assert [r.split(" ", 1)[1] for r in private_reach([t])] == ["._kept", ".ops._mm"[4:], "setattr _launch"]
    tree = ast.parse(b.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _queue_arg(n)]
    assert len(calls) == 1


# ---- the copy book ----
class _Buf:
    def __init__(self, ptr):
        self.int_ptr = ptr


def test_copy_book_keeps_stable_copies_until_forget():
    book, x, y = CopyBook(), _Buf(1), _Buf(2)
    book.stable(x)
    assert book.is_stable(x) and not book.is_stable(y)
    book.keep((1, 4, 4), ("copy", 64, 64))
    assert book.hit((1, 4, 4)) == ("copy", 64, 64) and book.hit((1, 4, 8)) is None
    assert book.forget() == [] and book.hit((1, 4, 4)) is None and book.is_stable(x)


def test_copy_book_reuse_blocks_do_not_nest_and_drop_their_copies():
    book, x, y = CopyBook(), _Buf(1), _Buf(2)
    book.begin_reuse(x)
    assert book.is_reusing(x) and not book.is_reusing(y)
    with pytest.raises(ClgptError, match="do not nest"):
        book.begin_reuse(y)
    book.keep((1, 4, 4), ("copy", 64, 64))
    book.keep((2, 4, 4), ("other", 64, 64))
    assert book.end_reuse(x) is None
    assert book.hit((1, 4, 4)) is None and book.hit((2, 4, 4)) == ("other", 64, 64) and not book.is_reusing(x)


def test_copy_book_premade_copies_are_taken_by_their_reuse_block_only():
    book, dh = CopyBook(), _Buf(3)
    book.premake(dh, ("copy", 128, 192, "sums", 2))
    with pytest.raises(ClgptError, match="read as fp32"):
        book.check_fp32(dh)
    with pytest.raises(ClgptError, match="read otherwise"):
        book.take_premade((3, 128, 192))  # outside its reuse block
    book.premake(dh, ("copy", 128, 192, "sums", 2))
    book.begin_reuse(dh)
    assert book.take_premade((3, 128, 192)) == ("copy", 128, 192)
    assert book.colsums_of((3, 128, 192)) == (2, "sums") and book.hit((3, 128, 192)) == ("copy", 128, 192)
    book.end_reuse(dh)
    assert book.colsums_of((3, 128, 192)) is None
    book.premake(dh, ("copy", 128, 192, None, 2))
    book.begin_reuse(dh)
    with pytest.raises(ClgptError, match="never read"):
        book.end_reuse(dh)


def test_copy_book_deferred_gelu_is_settled_once():
    book, dg, e = CopyBook(), _Buf(4), _Buf(5)
    book.defer_gelu(dg, e, 8, 16)
    assert book.deferred(dg).E is e and not book.deferred(dg).copied
    book.begin_reuse(dg)
    book.gelu_copied(dg)
    assert book.end_reuse(dg) is None and book.deferred(dg) is None  # copied: the fp32 buffer is read no more
    book.defer_gelu(dg, e, 8, 16)
    pending = book.forget()
    assert [(g.buf, g.rows, g.cols) for g in pending] == [(dg, 8, 16)] and book.deferred(dg) is None
    book.defer_gelu(dg, e, 8, 16)
    assert book.settle(dg).buf is dg and book.settle(dg) is None
