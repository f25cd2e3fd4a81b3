"""One evaluation in one pass over the weights: every validation window through each unit while
that unit's params are gathered once.

Evaluating window by window runs a whole forward per window, so with params on NVMe every
window reads every unit again: 128 windows read the model 128 times. Here the evaluation runs
layer-major, as the vertical schedule runs a step (`tierzero.engine.vertical.schedule`): the
embedding, each block and the head are gathered once (a tied embedding twice: the head binds
it again), and all the windows go through each in evaluation micro-batches, consecutive
windows joined row-wise into as many rows as the compute device's budget holds. No grad, no
recompute, nothing reaches the grad home; the swap runner replays the eval plan as the
per-window forward does.

Exactness. Each window's loss is its trained tokens' summed loss, from the head run on that
window's own rows with the divisor 1 (`Engine.eval_loss(batch, summed=True)`'s arithmetic);
the caller adds them in window order, as it adds per-window losses. The blocks run on joined
rows, and a row's values do not depend on the rows beside it as long as the kernels compute
each row alike: on the CPU in fp32 the built-in model and dense Hugging Face decoders come out
bitwise equal to the per-window path (tests/engine/test_evaluate.py, tests/hf/test_hf_evaluate.py).
A Mixture-of-Experts layer gathers each expert's tokens from every row of the micro-batch, so
its matmuls see another number of rows (equal within 1e-6 relative, measured about 1e-7), as
may a GPU's kernels, which can block a matmul differently per row count.

What waits. Between two units each micro-batch's hidden state waits for the next unit. They
stay on the compute device when they fit in its budget beside one micro-batch's working set;
else in a `BoundaryStore` (host memory under what the budget leaves, the rest spilled to
NVMe), taken in the order they were put. A Mixture-of-Experts decoder whose loss adds its
router aux loss (which the vertical schedule refuses) evaluates this way too: each layer's
router logits wait on the device beside the context, and each window's aux loss is computed
from its own tokens' logits. Where neither tier holds the hidden states, or the model is no
chain (`tierzero.engine.vertical.chain`: a root unit), the evaluation runs window by window,
and the engine notes why once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tierzero.config import Tier
from tierzero.engine.parts import EngineParts
from tierzero.engine.runtime.binding import bind, unbind
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.opened import OpenParts
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.vertical.boundary import BoundaryStore, aligned_nbytes
from tierzero.engine.vertical.chain import Chain, LayerChain, chain_of
from tierzero.layout.partition import Unit

Window = tuple[torch.Tensor, torch.Tensor]  # token ids, targets (rows x seq_len)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Inside, `model` is in eval mode (dropout off); its mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class EvalLayout:
    """How one evaluation runs: each micro-batch's windows (indices), and where hidden states
    wait between units (`store_bytes`: None on the device, else a store's host budget)."""

    micro_batches: list[list[int]]
    store_bytes: int | None


def evaluate_windows(
    parts: EngineParts,
    opened: OpenParts,
    windows: list[Any],
    one_window: Callable[[Any], float],
) -> list[float]:
    """Each window's summed trained-token loss, every unit read once for all of them; window
    by window (`one_window`) where the pass cannot run (the engine notes why)."""
    chain = eval_chain(parts.model, parts.layout.units)
    why = chain if isinstance(chain, str) else None
    if why is None and not all(isinstance(w, (tuple, list)) and len(w) == 2 for w in windows):
        why = "its batches are not (token ids, targets) pairs"
    layout = plan_layout(parts, chain, windows) if why is None else None
    if isinstance(layout, str):
        why = layout
    if why is not None or not windows:
        if why is not None:
            parts.note(
                "each evaluation runs window by window, a full pass over the units per window: "
                f"{why}"
            )
        return [one_window(w) for w in windows]
    assert isinstance(chain, Chain) and isinstance(layout, EvalLayout)
    with torch.no_grad(), evaluating(parts.model):
        return EvalPass(parts.layout, parts.device, parts.tiers, opened, chain, layout).run(windows)


def eval_chain(model: nn.Module, units: list[Unit]) -> Chain | str:
    """`model` as a chain for an evaluation: `chain_of`'s, and also a Hugging Face decoder whose
    router aux loss the vertical schedule refuses. Its forward-only pass carries each layer's
    router logits to the head itself (`EvalPass`), so the loss adds the aux loss as its own does."""
    chain = chain_of(model, units)
    owner = next(
        (m for m in model.modules() if callable(getattr(type(m), "layer_calls", None))), None
    )
    if (
        isinstance(chain, str)
        and owner is not None
        and getattr(owner, "router", None) is not None
        and getattr(owner, "final_norm", None) is not None
    ):
        return LayerChain(owner)
    return chain


def plan_layout(parts: EngineParts, chain: Chain, windows: list[Window]) -> EvalLayout | str:
    """The micro-batches and where their hidden states wait, from what the compute device's
    and the host's budgets leave beyond their pools; or why the pass cannot run.

    The hidden states of every window (`waiting`) stay on the device when they fit there
    beside one window's working set (`least`: a block's temporaries, the head's logits);
    else they go to a store under what the host budget leaves (on the CPU device the host is
    the compute device: what one window's working set leaves), spilling to NVMe. What the
    device's budget then has left sets how many windows' rows a micro-batch joins."""
    model, itemsize = parts.model, parts.layout.dtype.itemsize
    tokens = [w[0].numel() for w in windows]
    widest = max(tokens)
    seq_len = max(w[0].shape[-1] for w in windows)
    per_token = working_bytes_per_token(model, chain.dim, seq_len, itemsize)
    head = head_bytes(model, widest)
    least = head + per_token * widest
    waiting = sum(aligned_nbytes(n * chain.dim * itemsize) for n in tokens)
    device_room, host_room = rooms(parts)
    if waiting + least <= device_room:
        return EvalLayout(join(windows, (device_room - waiting - head) // per_token), None)
    store = min(waiting, host_room - (least if parts.device.type == "cpu" else 0))
    if store < 2 * aligned_nbytes(widest * chain.dim * itemsize) or (
        store < waiting and Tier.NVME not in parts.tiers.stores
    ):
        return (
            f"its waiting activations ({waiting / 1e6:.1f} MB) fit neither the compute device's "
            "budget nor the host's, and no state lives on NVMe to spill them to"
            if Tier.NVME not in parts.tiers.stores
            else f"the budgets leave {max(host_room, 0) / 1e6:.1f} MB, less than two windows' "
            "waiting activations and one window's working set"
        )
    room = device_room - head - (store if parts.device.type == "cpu" else 0)
    return EvalLayout(join(windows, room // per_token), store)


def join(windows: list[Window], tokens: int) -> list[list[int]]:
    """Consecutive windows of one sequence length, joined until a micro-batch holds `tokens`."""
    out: list[list[int]] = []
    held = 0
    for i, (ids, _) in enumerate(windows):
        n = ids.numel()
        if out and held + n <= tokens and ids.shape[1] == windows[out[-1][0]][0].shape[1]:
            out[-1].append(i)
            held += n
        else:
            out.append([i])
            held = n
    return out


def rooms(parts: EngineParts) -> tuple[int, int]:
    """Bytes the compute device's budget and the host's leave beyond their pools' peaks (after
    what the training batch and the vertical schedule reserved); on the CPU device one figure."""
    tiers, memory = parts.tiers, parts.sizing.current
    host = tiers.host_budget - memory.tiers[Tier.HOST].pool_bytes
    if parts.device.type == "cpu":
        return host, host
    return tiers.gpu_budget - memory.tiers[Tier.GPU].pool_bytes, host


def working_bytes_per_token(model: nn.Module, dim: int, seq_len: int, itemsize: int) -> int:
    """A block's forward temporaries per token without grad (the ledger's `block_forward_bytes`:
    its MLP's three F-wide temporaries, the normed input and output), its output beside, and a
    row of attention scores in fp32 per head (where attention materialises them)."""
    args, config = getattr(model, "args", None), getattr(model, "config", None)
    ffn = getattr(args, "ffn_dim", None) or getattr(config, "intermediate_size", None) or 4 * dim
    heads = getattr(args, "n_heads", None) or getattr(config, "num_attention_heads", None) or 1
    return (3 * int(ffn) + 3 * dim) * itemsize + int(heads) * seq_len * 4


def head_bytes(model: nn.Module, tokens: int) -> int:
    """The head's working set for one window of `tokens`: a loss chunk's fp32 logits and their
    log-softmax (the model's `loss_chunk_bytes` bounds a chunk)."""
    args, config = getattr(model, "args", None), getattr(model, "config", None)
    vocab = getattr(args, "vocab_size", None) or getattr(config, "vocab_size", None) or 0
    logits = tokens * int(vocab) * 4
    chunk = getattr(model, "loss_chunk_bytes", None)
    return 2 * (logits if not chunk else min(logits, int(chunk)))


class EvalPass:
    """Runs one evaluation layer-major (see the module docstring)."""

    def __init__(
        self,
        ranks: RankLayout,
        device: torch.device,
        tiers: Tiers,
        opened: OpenParts,
        chain: Chain,
        layout: EvalLayout,
    ) -> None:
        """`ranks`: this rank's units and dtype; `layout`: the micro-batches and their store."""
        self.units, self.dtype, self.device, self.tiers = ranks.units, ranks.dtype, device, tiers
        self.opened, self.chain, self.layout = opened, chain, layout
        self.runner, self.swap = opened.runner, opened.swap_runner
        self.store: BoundaryStore | None = None
        self._held: dict[int, torch.Tensor] = {}
        # a Mixture-of-Experts router aux loss: each micro-batch's router logits, layer by layer
        self.router = (
            getattr(chain.model, "router", None) if isinstance(chain, LayerChain) else None
        )
        self._logits: list[list[torch.Tensor]] = []

    def run(self, windows: list[Window]) -> list[float]:
        """Each window's summed trained-token loss, in window order."""
        groups = self.layout.micro_batches
        ids = [self.opened.batches.to_device(torch.cat([windows[i][0] for i in g])) for g in groups]
        targets = [[self.opened.batches.to_device(windows[i][1]) for i in g] for g in groups]
        for x in ids:
            self.chain.check(x)
        if self.layout.store_bytes is not None:
            self.store = BoundaryStore(
                self.tiers,
                self.layout.store_bytes,
                name="eval",
                in_put_order=True,
            )
        self.swap.begin(self.opened.eval_plan)
        try:
            contexts = self._embed(ids)
            for unit in self.units[1:-1]:
                self._block(unit, len(groups), contexts)
            losses = self._head(self.units[-1], targets)
            self.swap.finish()
        except BaseException:
            self.swap.abort()
            raise
        finally:
            if self.store is not None:
                self.store.clear()
            self._held.clear()
        return torch.stack(losses).tolist()  # host sync point: once per evaluation

    def _embed(self, ids: list[torch.Tensor]) -> list[Any]:
        """The embedding over every micro-batch; each one's context (what its layers take)."""
        unit = self.units[0]
        contexts = []
        with self._gathered(unit):
            for m, x in enumerate(ids):
                hidden, context = self.chain.embed(self.runner, unit, x)
                contexts.append(_without_hidden(context))
                self._keep(unit.index + 1, m, hidden)
        return contexts

    def _block(self, unit: Unit, micro_batches: int, contexts: list[Any]) -> None:
        if self.router is not None and not self._logits:
            self._logits = [[] for _ in range(micro_batches)]
        with self._gathered(unit):
            for m in range(micro_batches):
                x = self._take(unit.index, m)
                self._keep(unit.index + 1, m, self._layer(unit, x, contexts[m], m))

    def _layer(self, unit: Unit, x: torch.Tensor, context: Any, m: int) -> torch.Tensor:
        """The block's output; a Mixture-of-Experts block returns its router logits beside it
        (`tierzero.hf.router`), kept for the head."""
        if self.router is None:
            return self.chain.block(self.runner, unit, x, context)
        args, kwargs = context[unit.index - 1].with_hidden(x)
        out, logits = self.runner.compute(unit, args, kwargs, leaves=[])
        self._logits[m].extend(logits)
        return out[0] if isinstance(out, tuple) else out

    def _head(self, unit: Unit, targets: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Each window's summed loss: the head on that window's own rows, divided by 1."""
        losses = []
        with self._gathered(unit):
            for m, window_targets in enumerate(targets):
                x, start = self._take(unit.index, m, last=True), 0
                for y in window_targets:
                    rows = slice(start, start + y.shape[0])
                    losses.append(self._window_loss(unit, x[rows], y, m, rows))
                    start = rows.stop
        return losses

    def _window_loss(
        self, unit: Unit, x: torch.Tensor, y: torch.Tensor, m: int, rows: slice
    ) -> torch.Tensor:
        """One window's summed loss; with a router aux loss, from that window's tokens' router
        logits of every layer, as the model's forward of the window alone hands them to its head."""
        if self.router is None:
            return self.chain.head(self.runner, unit, x, y, 1.0)
        tokens = slice(
            rows.start * y.shape[1], rows.stop * y.shape[1]
        )  # logits: (rows x seq, experts)
        logits = tuple(layer[tokens] for layer in self._logits[m]) or None
        self.router.start(None)  # the window's forward has no attention mask
        kwargs = {"num_items_in_batch": 1.0, "router_logits": logits}
        return self.runner.compute(unit, (x, y), kwargs, leaves=[])

    @contextlib.contextmanager
    def _gathered(self, unit: Unit) -> Iterator[None]:
        """`unit` (and what it binds with it: a tied head's embedding) bound to params gathered
        once, as the eval plan lists them; released after."""
        bound = self.runner.bound_units(unit)
        for u in bound:
            bind(u, self.runner.gather(u.index))
        try:
            yield
        finally:
            for u in bound:
                unbind(u, self.dtype, self.device)
            self.runner.release(unit.index)

    def _keep(self, unit: int, micro: int, x: torch.Tensor) -> None:
        """`x` waits as unit `unit`'s input for micro-batch `micro`. Spilled entries are read
        back ahead only with the room left after a put: room a `get` frees goes to the put
        that follows it, not to an entry the put would then drop again."""
        if self.store is None:
            self._held[micro] = x
        else:
            self.store.put(unit, micro, x)
            self.store.prefetch()

    def _take(self, unit: int, micro: int, last: bool = False) -> torch.Tensor:
        """Unit `unit`'s input for micro-batch `micro`; `last`: no put follows (the head)."""
        if self.store is None:
            return self._held.pop(micro)
        x = self.store.get(unit, micro)
        if last:
            self.store.prefetch()
        return x


def _without_hidden(context: Any) -> Any:
    """A Hugging Face micro-batch's recorded layer calls hold the first hidden state; the
    waiting activation is its one copy (the calls' other arguments are what the layers take)."""
    for call in context or ():
        call.hidden = None
    return context
