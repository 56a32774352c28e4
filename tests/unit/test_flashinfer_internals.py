"""What the package reads of FlashInfer's internals (runtime/flashinfer_internals.py).

Every such read is a row of `INTERNALS`, read where the row says, and every row is read.
The package is scanned statically (`ast`). A scan cannot tell what object a name holds,
so it takes every private attribute the package touches on anything but `self` / `cls`
(`x._name`, and getattr / hasattr / setattr / delattr with such a name as a constant;
dunders aside), and every `flashinfer...` / `nccl...` module path it names, and each must
be either a row of the table, read in one of the places the row names (an accessor of the
seam, or a module of `read_in`), or a private read of something that is not FlashInfer's,
listed in NOT_FLASHINFER below with its owner. So a new private read of any kind fails
until it is classified, and a row or an entry nothing reads fails as stale.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

import vllm_flashinfer_ep
from vllm_flashinfer_ep.runtime import flashinfer_internals as internals
from vllm_flashinfer_ep.runtime import native_handle

PACKAGE = "vllm_flashinfer_ep"
ROOT = Path(vllm_flashinfer_ep.__file__).resolve().parent
SEAM = internals.__name__

# Private reads of things that are not FlashInfer's: (module, receiver, name) -> owner.
NOT_FLASHINFER: dict[tuple[str, str, str], str] = {
    ("vllm_flashinfer_ep.runtime.capture", "torch", "_C"): "torch's C extension",
    (
        "vllm_flashinfer_ep.runtime.capture",
        "torch._C",
        "_cuda_getCurrentRawStream",
    ): "torch: the raw current stream in one C call (capture.py says why)",
    (
        "vllm_flashinfer_ep.runtime.capture",
        "torch._C",
        "_cuda_isCurrentStreamCapturing",
    ): "torch: the capture query in one C call (capture.py says why)",
    (
        "vllm_flashinfer_ep.vllm.patches.platform",
        "arg_utils",
        "_compute_kwargs",
    ): "vLLM: the backend_names patch clears the CLI's cache (a row of the patch table)",
    (
        "vllm_flashinfer_ep.experts.received_rows",
        "BatchedTritonExperts",
        "_supports_quant_scheme",
    ): "vLLM's experts contract: the parent class's answer (the device's FP8 support)",
    **{
        ("vllm_flashinfer_ep.vllm.capture_plan", "manager", name): (
            "vLLM: the V2 runner's capture descriptors, computed by its own code on a "
            "config-only CudaGraphManager (capture_plan.py says why)"
        )
        for name in ("_candidates", "_capture_descs", "_init_candidates")
    },
}
PUBLIC_MODULES = {"flashinfer", "flashinfer.moe_ep", "nccl", "nccl.ep"}
MODULE_PATH = re.compile(r"^(flashinfer|nccl)(\.[A-Za-z_]\w*)*$")
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


@dataclass(frozen=True)
class Read:
    module: str
    receiver: str  # the expression the name is read on ("" for a module path)
    name: str  # the private attribute, or the module path
    line: int
    function: str | None  # the enclosing top-level function, if any


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Scanner(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.found: list[Read] = []
        self._functions: list[str] = []

    def _add(self, receiver: str, name: str, node: ast.AST) -> None:
        function = self._functions[0] if self._functions else None
        self.found.append(Read(self.module, receiver, name, node.lineno, function))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._functions.append(node.name)
        self.generic_visit(node)
        self._functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        receiver = ast.unparse(node.value)
        if _private(node.attr) and receiver not in ("self", "cls"):
            self._add(receiver, node.attr, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            receiver = ast.unparse(node.args[0])
            if receiver not in ("self", "cls"):
                self._add(receiver, node.args[1].value, node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and MODULE_PATH.match(node.value):
            self._add("", node.value, node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if MODULE_PATH.match(alias.name):
                self._add("", alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and MODULE_PATH.match(module):
            self._add("", module, node)
            for alias in node.names:
                if _private(alias.name):
                    self._add(module, alias.name, node)


def scan_source(source: str, module: str) -> list[Read]:
    scanner = _Scanner(module)
    scanner.visit(ast.parse(source))
    return scanner.found


def scan_package() -> list[Read]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found += scan_source(path.read_text(), module)
    return found


def problem(read: Read) -> str | None:
    """Why `read` is not accounted for (None: it is)."""
    where = f"{read.module}:{read.line} {read.receiver + '.' if read.receiver else ''}{read.name}"
    if not read.receiver and read.name in PUBLIC_MODULES:
        return None
    row = internals.BY_NAME.get(read.name)
    if row is not None and (row.kind == internals.MODULE) == (not read.receiver):
        if read.module == SEAM and row.accessor is not None:
            # an attribute in its accessor; a module path where the table names it
            if read.function == (row.accessor if read.receiver else None):
                return None
            return f"{where}: read in {read.function}(), not by the row's accessor {row.accessor}()"
        if read.module in row.read_in:
            return None
        return f"{where}: a row of INTERNALS, but not read here (read_in: {row.read_in})"
    if (read.module, read.receiver, read.name) in NOT_FLASHINFER:
        return None
    return f"{where}: a private read no row of flashinfer_internals.INTERNALS lists"


def _problems(reads: list[Read]) -> list[str]:
    return [p for p in map(problem, reads) if p is not None]


READS = scan_package()


def test_every_private_read_of_the_package_is_listed():
    assert not _problems(READS)


def test_every_row_is_read_where_it_says():
    """The table is exact both ways: a row, or a place of a row, that nothing reads fails
    (so the scan above is never vacuous: it finds every row's reads)."""
    seen = {(r.module, r.name, r.function) for r in READS}
    places = {(r.module, r.name) for r in READS}
    for row in internals.INTERNALS:
        for module in row.read_in:
            assert (module, row.name) in places, (row.name, module)
        if row.accessor is not None:
            reader = row.accessor if row.kind == internals.ATTRIBUTE else None
            assert (SEAM, row.name, reader) in seen, (row.name, row.accessor)
            assert callable(getattr(internals, row.accessor)), row.accessor
        assert row.read_in or row.accessor, f"{row.name}: read nowhere"
        assert bool(row.read_in) == bool(row.in_place), f"{row.name}: say why it stays in place"
    listed = {(r.module, r.receiver, r.name) for r in READS}
    assert not set(NOT_FLASHINFER) - listed, "stale NOT_FLASHINFER entries"


def test_today_s_reads_are_found():
    """Spot checks of the scan against reads known to be in the tree."""
    found = {(r.module.rpartition(".")[2], r.receiver, r.name) for r in READS}
    for known in [
        ("fp8_wire", "handle", "_handle"),
        ("fp8_wire", "handle", "_recv_count_t"),
        ("fp8_wire", "handle", "_num_tokens_in"),
        ("native_handle", "handle", "_ep"),
        ("native_handle", "handle", "_handle"),
        ("flashinfer_internals", "handle", "_stream"),
        ("flashinfer_internals", "", internals.HANDLE_MODULE),
        ("transport", "", "flashinfer.moe_ep"),
    ]:
        assert known in found, known


@pytest.mark.parametrize(
    "source",
    [
        "def dispatch(handle):\n    return handle._hot\n",  # an unlisted attribute
        "def dispatch(handle):\n    return getattr(handle, '_fleet')\n",  # by name
        "import importlib\nm = importlib.import_module('flashinfer.moe_ep.core.comm')\n",
        "from flashinfer.moe_ep.backends.split.comm.nccl_ep import fleet\n",
        "from flashinfer.moe_ep import _private_helper\n",
        "def dispatch(handle):\n    return handle._stream\n",  # a row, but not read here
    ],
)
def test_the_scan_refuses_an_unlisted_read(source):
    reads = scan_source(source, "vllm_flashinfer_ep.runtime.fp8_wire")
    assert reads and _problems(reads)


def test_an_accessor_reads_only_its_own_row():
    source = "def is_ht(handle):\n    return handle._staged\n"
    assert _problems(scan_source(source, SEAM))


def test_the_rows_were_read_from_the_installed_flashinfer():
    """Every handle attribute of the table is set or defined by NcclEpHandle of the
    FlashInfer the rows name (read from its source, without running it)."""
    assert importlib.metadata.version("flashinfer-python") in internals.READ_FROM
    origin = importlib.util.find_spec(internals.HANDLE_MODULE).origin
    tree = ast.parse(Path(origin).read_text())
    (cls,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == internals.HANDLE_OWNER
    ]
    defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    defined |= {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }
    assert set(internals.HANDLE_ATTRIBUTES) <= defined, set(internals.HANDLE_ATTRIBUTES) - defined
    handle_class = internals.handle_class()
    assert handle_class is not None and handle_class.__name__ == internals.HANDLE_OWNER


def _handle(**drop):
    values = {name: object() for name in internals.HANDLE_ATTRIBUTES}
    for name in drop:
        del values[name]
    return SimpleNamespace(**values)


def test_check_names_what_a_handle_lacks_in_table_order():
    assert internals.check(_handle()) is None
    message = internals.check(_handle(_wrap=1, _staged=1, _handle=1))
    assert "lacks ['_handle', '_wrap', '_staged']" in message
    assert internals.READ_FROM in message
    # native_handle's check is this one (and its refusal is logged, not raised)
    assert native_handle.native_reason(_handle(_op_stream=1)) == internals.check(
        _handle(_op_stream=1)
    )


@pytest.mark.usefixtures("fake")
def test_the_fake_handle_has_every_attribute_the_table_lists():
    from tests.fakes.runtime import build_fake_runtime
    from vllm_flashinfer_ep.backends import Algorithm

    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=2048, sizes=[2])
    handle = rt.pool.any_handle()
    assert internals.check(handle) is None
    assert internals.nccl_ep_of(handle) is handle._ep
    assert internals.handle_stream(handle) == 0
    assert (internals.is_ht(handle), internals.is_rank_major(handle)) == (False, False)
    assert internals.is_staged(handle) is False


def test_the_patch_index_lists_every_row():
    from vllm_flashinfer_ep.vllm import patches

    text = patches.index()
    for row in internals.INTERNALS:
        assert row.entry() in text
        assert row.upstream in text and row.read_from in text


def _rows() -> Iterator[internals.Internal]:
    yield from internals.INTERNALS


@pytest.mark.parametrize("row", list(_rows()), ids=lambda row: row.name)
def test_every_row_says_what_why_and_what_removes_it(row):
    assert row.what and row.why and row.upstream and row.read_from
    assert row.kind in (internals.ATTRIBUTE, internals.MODULE)
