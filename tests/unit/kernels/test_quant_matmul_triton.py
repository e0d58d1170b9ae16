"""The GGUF dequantize-matmul (kernels/triton/quant_matmul.py) on Q4_0, Q4_1 and Q8_0 blocks that
`gguf` quantized: its torch reference dequantizes as gguf does, bit for bit; the kernel stays
within a rounding bound of the reference in float32 and bf16, float32 logits included; a row's
bits are the same whatever the rows around it; K of partial blocks is refused; and a weight kept
in blocks goes to it through linear() where Triton runs (forced on CPU here, as on CUDA).

Without a GPU the kernel runs in Triton's interpreter, which multiplies in float32 and truncates
casts to bf16 where the reference rounds them: bf16 is compared within one bf16 step of every
weight and of the result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pdserve.kernels import linear as linear_module
from pdserve.kernels.linear import linear, pack_linear_weights
from pdserve.kernels.quant_linear import QTYPES, GGUFRows, kept_qtypes
from pdserve.kernels.triton.matmul_configs import QUANT_MATMUL_TILES
from pdserve.kernels.triton.quant_matmul import (
    dequantize_torch,
    quant_matmul_torch,
    quant_matmul_triton,
)
from pdserve.models.layers.linear import ReplicatedLinear

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def _weight(name: str, n: int, k: int, seed: int = 0) -> tuple[GGUFRows, np.ndarray]:
    """(a random [n, k] weight in `name`'s blocks, its raw rows as gguf wrote them)."""
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k), dtype=np.float32), GGMLQuantizationType[name])
    return GGUFRows(torch.from_numpy(raw).to(DEVICE), QTYPES[name], n, k), raw


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("name", FORMATS)
def test_the_reference_dequantizes_as_gguf(name: str) -> None:
    weight, raw = _weight(name, 5, 96)
    want = dequantize(raw, GGMLQuantizationType[name])
    assert torch.equal(dequantize_torch(weight).cpu(), torch.from_numpy(want))


def _assert_near(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|got - want| within `step` of sum |x w| and of |want|: for bf16 one bf16 step of every
    weight (the interpreter truncates) and of the result, for float32 the sums' order."""
    k = x.shape[-1]
    step = 2**-7 + k * 2**-24 if x.dtype == torch.bfloat16 else k * 2**-24
    magnitude = x.abs().float() @ w.abs().float().T
    bound = step * (magnitude + want.abs().float())
    excess = (got.float() - want.float()).abs() - bound
    assert excess.max() <= 0, f"past the bound by {excess.max():.3g}"


# (format, dtype, rows, N, K, bias): N past a tile's edge; K over several steps, bf16's last
# step half full; rows past a row tile (64).
CASES = [
    (name, dtype, m, n, k, bias)
    for name in FORMATS
    for dtype, m, n, k, bias in [
        (torch.float32, 3, 70, 96, False),
        (torch.bfloat16, 70, 40, 160, True),
    ]
]


@pytest.mark.parametrize(("name", "dtype", "m", "n", "k", "bias"), CASES)
def test_matches_reference(
    name: str, dtype: torch.dtype, m: int, n: int, k: int, bias: bool
) -> None:
    weight, _ = _weight(name, n, k)
    x = _randn(m, k, dtype=dtype, seed=1)
    b = _randn(n, dtype=dtype, seed=2) if bias else None
    w = dequantize_torch(weight).to(dtype)
    # Logits: the float32 sums themselves, never rounded to the activations' dtype.
    for out_dtype in dict.fromkeys((dtype, torch.float32)):
        got = quant_matmul_triton(x, weight, b, out_dtype)
        assert got.shape == (m, n) and got.dtype == out_dtype
        want = quant_matmul_torch(x, weight, b, out_dtype)
        _assert_near(got, want, x, w)


def test_leading_dimensions_and_no_rows() -> None:
    weight, _ = _weight("Q4_0", 24, 64)
    x = _randn(6, 64, dtype=torch.float32, seed=1)
    got = quant_matmul_triton(x.view(2, 3, 64), weight, None, torch.float32)
    assert got.shape == (2, 3, 24)
    assert torch.equal(got.view(6, 24), quant_matmul_triton(x, weight, None, torch.float32))
    assert quant_matmul_triton(x[:0], weight, None, torch.float32).shape == (0, 24)


# Batch sizes around the row tile (past it: a second one).
ROWS = [1, 2, 3, 17, 64, 65, 70]


def _positions(m: int, dtype: torch.dtype) -> list[int]:
    """Where the probe sits in a batch of m rows: first and last on a GPU. The interpreter runs
    tl.dot as numpy's sgemm, which rounds a row by its place in the block (OpenBLAS's edge
    kernels): there, the first row of each row tile."""
    if DEVICE.type == "cuda":
        return [0, m - 1]
    return list(range(0, m, QUANT_MATMUL_TILES[dtype].block_m))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    ("dtype", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_rows_do_not_depend_on_the_batch(
    name: str, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    weight, _ = _weight(name, 72, 96)  # N past a tile's edge, K 1.5 of bf16's steps
    bias = _randn(72, dtype=dtype, seed=2)
    probe = _randn(1, 96, dtype=dtype, seed=3)
    alone = quant_matmul_triton(probe, weight, bias, out_dtype)[0]
    for m in ROWS:
        x = _randn(m, 96, dtype=dtype, seed=m)
        positions = _positions(m, dtype)
        x[positions] = probe
        got = quant_matmul_triton(x, weight, bias, out_dtype)
        for row in positions:
            assert torch.equal(got[row], alone), f"{m} rows, the probe at row {row}"


def test_what_it_cannot_read_is_refused() -> None:
    weight, _ = _weight("Q8_0", 8, 64)
    x = torch.zeros(2, 48, device=DEVICE)
    partial = GGUFRows(weight.data[:, : 48 // 32 * 34], weight.qtype, 8, 48)
    with pytest.raises(ValueError, match="in_features=48 is not a multiple of 32"):
        quant_matmul_triton(x, partial, None, torch.float32)
    q4_k = GGUFRows(torch.zeros(8, 144, dtype=torch.uint8), QTYPES["Q4_K"], 8, 256)
    with pytest.raises(ValueError, match="GGUF type 12 has no Triton kernel"):
        quant_matmul_triton(torch.zeros(2, 256), q4_k, None, torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dispatch_follows_forced_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, torch.dtype]] = []
    for kind in ("triton", "torch"):
        monkeypatch.setattr(
            linear_module,
            f"quant_matmul_{kind}",
            lambda x, w, b, out_dtype, kind=kind: calls.append((kind, out_dtype)),
        )
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", backend)
    weight, _ = _weight("Q4_1", 8, 32)
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEVICE)
    linear(x, weight.data, None, weight)
    linear(x, weight.data, None, weight, torch.float32)
    assert calls == [(backend, torch.bfloat16), (backend, torch.float32)]


def test_where_the_triton_kernel_takes_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA keeps the Triton kernel's formats, a CPU the CPU kernel's (Q4_K too), unless the
    Triton backend is forced."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    triton_formats = (QTYPES["Q4_0"], QTYPES["Q4_1"], QTYPES["Q8_0"])
    assert kept_qtypes(cuda) == triton_formats
    assert kept_qtypes(cpu) == tuple(QTYPES.values())
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    assert kept_qtypes(cpu) == triton_formats


@pytest.mark.parametrize("name", FORMATS)
def test_a_kept_projection_runs_on_its_blocks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the loader hands a layer (uint8 rows with `gguf_qtype`), packed as the engine packs
    it where Triton runs: the rows as they are, in place, read by the kernel."""
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    weight, raw = _weight(name, 40, 64)
    layer = ReplicatedLinear(64, 40, bias=True, params_dtype=torch.float32)
    loaded = torch.from_numpy(raw)
    loaded.gguf_qtype = QTYPES[name]
    layer.weight.weight_loader(layer.weight, loaded)
    layer.bias.data.copy_(torch.randn(40))
    layer.to(DEVICE)
    assert pack_linear_weights(layer) == 1
    rows = layer.packed_weight
    assert isinstance(rows, GGUFRows) and rows.data.data_ptr() == layer.weight.data_ptr()
    x = _randn(5, 64, dtype=torch.float32, seed=1)
    want = quant_matmul_triton(x, weight, layer.bias, torch.float32)
    assert torch.equal(layer(x), want)
