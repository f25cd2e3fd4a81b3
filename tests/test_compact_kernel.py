"""The compact step's CPU kernel against its torch ops, bitwise: every format of master, moments
and grad, pieces whose numel is no multiple of the block, spans with their own weight decay and
step count (and gaps no span covers, and a sub-block none reaches), blocks of zeros, of huge
and tiny values, of infinities and NaNs; several steps in a row. The one freedom: a value that
is NaN in both may be another NaN. And the fallback: where the kernel cannot be had, the step
runs on torch's ops and says so once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from tierzero.compact import cpu_step
from tierzero.compact import step as step_mod
from tierzero.compact.formats import StateFormats
from tierzero.compact.step import SUB_BLOCK, CompactStep
from tierzero.config import STATE_BLOCK, Config, StateKind

SUB = SUB_BLOCK["cpu"]
FORMATS = [(m, w) for m in ("fp32", "bf16", "int8") for w in ("fp32", "bf16")]  # (moments, master)
CPU = torch.device("cpu")


def _values(n: int, scale: float, g: torch.Generator, positive: bool = False) -> torch.Tensor:
    """Random values around `scale`, with blocks of every kind the quantiser and rounding meet."""
    x = torch.randn(n, generator=g) * scale
    x[3 * STATE_BLOCK : 4 * STATE_BLOCK] = 0.0  # a block of zeros
    x[5 * STATE_BLOCK : 6 * STATE_BLOCK] *= 1e30  # huge
    x[7 * STATE_BLOCK : 8 * STATE_BLOCK] *= 1e-30  # tiny (subnormal once squared or quantised)
    x[9 * STATE_BLOCK + 4 : 9 * STATE_BLOCK + 5] = float("inf")
    x[11 * STATE_BLOCK + 9 : 11 * STATE_BLOCK + 10] = float("nan")
    x[13 * STATE_BLOCK : 13 * STATE_BLOCK + 100] = 0.0  # part of a block
    x[-1] = 0.0
    return x.abs() if positive else x


def _piece(
    formats: StateFormats, n: int, seed: int, grad: torch.dtype
) -> dict[StateKind, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        StateKind.MASTER: formats.encode(StateKind.MASTER, _values(n, 0.05, g)),
        StateKind.EXP_AVG: formats.encode(StateKind.EXP_AVG, _values(n, 1e-3, g)),
        StateKind.EXP_AVG_SQ: formats.encode(
            StateKind.EXP_AVG_SQ, _values(n, 1e-6, g, positive=True)
        ),
        StateKind.GRAD: (_values(n, 1e-2, g) * torch.logspace(-3, 3, n)).to(grad),
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, but for which NaN a value is where two NaNs met in an op (x86 keeps the
    first operand's, and torch's vector and scalar loops put them in different orders)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    bits = torch.int32 if a.element_size() == 4 else torch.int16
    return bool(((a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())).all())


@pytest.fixture
def kernel() -> Iterator[None]:
    if step_mod.cpu_kernel() is None:
        pytest.fail("numba's kernel is unavailable here: see the log record for why")
    yield


@pytest.mark.parametrize("grad", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moments,master", FORMATS)
def test_the_kernel_steps_a_piece_bitwise_as_the_torch_ops_do(
    kernel: None, moments: str, master: str, grad: torch.dtype
) -> None:
    formats = StateFormats(moments=moments, master=master)
    config = Config(lr=1e-3, weight_decay=0.1, seed=7)
    n = 3 * SUB + 5 * STATE_BLOCK + 77  # four sub-blocks, the last block short
    # spans of different decay and step count, a gap inside a sub-block, a sub-block no span
    # reaches (its bytes stay), a span across a sub-block edge and one ending mid-block
    spans = [
        (0, 1000, 0.1, 0),
        (1000, 5000, 0.0, 7),
        (6001, SUB + 3000, 0.1, 2),
        (3 * SUB + 100, 3 * SUB + 900, 0.1, 11),
        (3 * SUB + 1200, n, 0.0, 1),
    ]
    torch_ops = _piece(formats, n, 1, grad)
    fast = {kind: t.clone() for kind, t in torch_ops.items()}
    for step in range(3):  # each step re-encodes what the one before wrote
        lr = 1e-3 * (step + 1)
        stepped = [(a, b, wd, k + step) for a, b, wd, k in spans]
        CompactStep(formats, config.optimizer, config.seed, CPU, kernel=False).step(
            torch_ops, stepped, lr, unit=5, origin=2**32 - 7000
        )
        CompactStep(formats, config.optimizer, config.seed, CPU).step(
            fast, stepped, lr, unit=5, origin=2**32 - 7000
        )
        for kind in torch_ops:
            assert _same_bytes(fast[kind], torch_ops[kind]), (step, kind)
    untouched = slice(2 * SUB, 3 * SUB)  # no span reaches it: the stored values are the first ones
    first = _piece(formats, n, 1, grad)[StateKind.MASTER]
    assert _same_bytes(fast[StateKind.MASTER][untouched], first[untouched])


@pytest.mark.parametrize("moments,master", [("int8", "bf16"), ("bf16", "fp32")])
def test_a_piece_shorter_than_a_block_and_spans_given_out_of_order(
    kernel: None, moments: str, master: str
) -> None:
    formats = StateFormats(moments=moments, master=master)
    config = Config(lr=1e-3, weight_decay=0.1, seed=3)
    for n in (1, 100, STATE_BLOCK + 1):
        spans = [(n // 2, n, 0.1, 3), (0, n // 2, 0.0, 0)]
        torch_ops = _piece(formats, n, n, torch.float32)
        fast = {kind: t.clone() for kind, t in torch_ops.items()}
        CompactStep(formats, config.optimizer, config.seed, CPU, kernel=False).step(
            torch_ops, spans, 1e-3, unit=0, origin=9
        )
        CompactStep(formats, config.optimizer, config.seed, CPU).step(
            fast, spans, 1e-3, unit=0, origin=9
        )
        assert all(_same_bytes(fast[k], torch_ops[k]) for k in fast), n


@pytest.fixture
def no_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """numba's compiler failing: `cpu_step.load` raises, and `cpu_kernel()` is asked afresh."""

    def broken() -> None:
        raise OSError("no compiler here")

    monkeypatch.setattr(cpu_step, "load", broken)
    step_mod.cpu_kernel.cache_clear()
    yield
    step_mod.cpu_kernel.cache_clear()


def test_without_the_kernel_the_step_runs_on_torch_ops_and_says_so_once(
    no_kernel: None, caplog: pytest.LogCaptureFixture
) -> None:
    formats = StateFormats(moments="int8", master="bf16")
    config = Config(lr=1e-3, weight_decay=0.1, seed=7)
    n = SUB + 1000
    torch_ops = _piece(formats, n, 2, torch.float32)
    fallen_back = {kind: t.clone() for kind, t in torch_ops.items()}
    stepper = CompactStep(formats, config.optimizer, config.seed, CPU)
    with caplog.at_level(logging.WARNING, logger=step_mod.__name__):
        for step in range(2):
            stepper.step(fallen_back, [(0, n, 0.1, step)], 1e-3, unit=1, origin=0)
            CompactStep(formats, config.optimizer, config.seed, CPU, kernel=False).step(
                torch_ops, [(0, n, 0.1, step)], 1e-3, 1, 0
            )
    records = [r for r in caplog.records if r.name == step_mod.__name__]
    assert len(records) == 1 and "no compiler here" in records[0].getMessage()
    assert all(_same_bytes(fallen_back[k], torch_ops[k]) for k in torch_ops)


def test_a_dtype_the_kernel_does_not_decode_steps_on_torch_ops(kernel: None) -> None:
    """An fp16 grad (no home stores one today) is no crash: `usable` sends it to the torch ops."""
    formats = StateFormats(moments="int8", master="bf16")
    config = Config(lr=1e-3, weight_decay=0.1, seed=5)
    n = 3 * STATE_BLOCK + 10
    torch_ops = _piece(formats, n, 4, torch.float16)
    assert not cpu_step.usable(torch_ops)
    fast = {kind: t.clone() for kind, t in torch_ops.items()}
    CompactStep(formats, config.optimizer, config.seed, CPU, kernel=False).step(
        torch_ops, [(0, n, 0.1, 2)], 1e-3, 2, 0
    )
    CompactStep(formats, config.optimizer, config.seed, CPU).step(
        fast, [(0, n, 0.1, 2)], 1e-3, 2, 0
    )
    assert all(_same_bytes(fast[k], torch_ops[k]) for k in fast)


def test_the_kernel_leaves_torchs_thread_count_as_it_found_it(kernel: None) -> None:
    """Starting numba's threads (OpenMP's, where it is the layer: torch's libgomp) once reset
    the calling thread's team to all of numba's threads, torch's `get_num_threads` with it. The
    first start is once per process, so it is checked in a fresh one."""
    script = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from tierzero.compact.step import cpu_kernel\n"
        "assert cpu_kernel() is not None\n"
        "print(torch.get_num_threads())\n"
    )
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1"], out.stdout
