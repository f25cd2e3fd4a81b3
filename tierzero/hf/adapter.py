"""`CausalLM`: a Hugging Face causal LM seen through tierzero's model contract.

The contract (the built-in model's): `model(input_ids, targets)` returns the mean
cross-entropy of already-shifted `targets` (tierzero's batches are `(x, y)` with `y` = `x`
shifted by one, so no token is lost at the window's end and nothing is shifted twice); the
decoder layers are the blocks; `get_input_embeddings()` is the embedding unit; and, where the
model allows it, `head_out(hidden, targets)` runs everything after the blocks as the head unit.
A dict batch may instead pass Hugging Face `labels` (unshifted: HF shifts them) and an
`attention_mask`.

The adapter registers the Hugging Face model's children as its own, so parameter names are
exactly the checkpoint's (`model.layers.0.self_attn.q_proj.weight`): weights load and export
under them. The loss always comes from the model's own code: its forward (logit scaling and
soft-capping included) and its `loss_function`, fed `shift_labels`. The KV cache is off
(`use_cache=False`): a cache object passed to a layer would be reused by the recompute in
backward and double the keys and values. Generation alone passes one (`forward(ids, cache=...)`,
`tierzero.hf.decode`): no grad, no recompute, and the logits of the last position only.

Two layouts (see `tierzero.layout.partition`):

- *split* -- when every parameter outside the layers, the input embedding and the output
  embedding belongs to a learned position table (GPT-2's `wpe`, OPT's `embed_positions`) or to
  one final norm (LLaMA, Mistral, Qwen, Gemma, NeoX, GPT-2, OPT; OLMo's has no parameters).
  The base model is the module that runs the layers (OPT's head calls `model.decoder` itself).
  Position tables join the token embedding in the embedding unit (`tierzero.hf.prelude`). The
  final norm's call inside the base model's forward passes the hidden state through
  (`_deferred`), and `head_out` applies it, then runs the model's own head on that hidden state
  by having the base model return it (`_returning`). The vertical schedule calls its units
  one by one: `layer_calls` records what the base model's forward passes each layer
  (`tierzero.hf.layercalls`), `first_hidden` is that forward up to the first layer.
- *root* -- otherwise (two norms, a projection after the layers): no `head_out`, so
  everything outside the layers is one root unit, bound for the whole pass, and the forward
  is the model's own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierzero.checkpoint.hf_format import SavedFormat
from tierzero.errors import ConfigError
from tierzero.hf.decode import HFCache, check_positions
from tierzero.hf.layercalls import LayerCall, chained, recording, refuse_unchained
from tierzero.hf.positions import position_limit
from tierzero.hf.prelude import Prelude, replaying, stop_at
from tierzero.hf.router import RouterLogits, routes
from tierzero.models.llama import loss_chunk_bytes, unit_seed
from tierzero.models.loss import IGNORE_INDEX, chunk_tokens_for
from tierzero.models.weights import WeightFiles


class CausalLM(nn.Module):
    """A Hugging Face `*ForCausalLM` with tierzero's batch contract; the root layout."""

    OUTSIDE: tuple[str, ...] = ("root",)  # the units outside the blocks

    def __init__(self, hf_model: nn.Module, blocks: str) -> None:
        super().__init__()
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf_model", hf_model)  # not a child: names stay the checkpoint's
        self.blocks_path = blocks
        self.config = hf_model.config
        # peft reads it to scope the conversion mapping
        self.base_model_prefix = hf_model.base_model_prefix
        self.saved_format = SavedFormat(hf_model)
        parent = blocks.rpartition(".")[0]
        object.__setattr__(self, "base", hf_model.get_submodule(parent) if parent else hf_model)
        moe = routes(self.base)
        # the base collects no router logits
        self.quiet = {"output_router_logits": False} if moe else {}
        aux = moe and bool(getattr(self.config, "output_router_logits", False))
        self.router = RouterLogits(self.base, self.blocks) if aux else None

    @property
    def blocks(self) -> nn.ModuleList:
        return self.get_submodule(self.blocks_path)

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def read_weight(
        self, files: WeightFiles, names: tuple[str, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The parameter called `names` from `files`, fp32: under its own name, or as transformers
        loads it from what `save_pretrained` wrote (GPT-NeoX's `lm_head.weight` saved as
        `embed_out.weight`; a Mixture-of-Experts layer's fused experts stacked from one tensor
        per expert), one parameter at a time (`tierzero.checkpoint.hf_format`)."""
        return self.saved_format.read(files, names, shape)

    def train(self, mode: bool = True) -> CausalLM:
        super().train(mode)
        self.hf_model.training = mode  # the top module is not a child; its own flag follows
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
        cache: HFCache | None = None,
    ) -> Any:
        """The loss of `targets` (shifted) or `labels` (unshifted); logits when given neither.
        `num_items_in_batch`: what the summed token losses are divided by (`tierzero.models.loss`).
        With a `cache` (generation), the last position's logits after `input_ids` (`decode`)."""
        if cache is not None:
            return self.decode(input_ids, cache)
        if self.router is not None:
            self.router.start(attention_mask)
        logits = self.hf_model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **self.quiet
        ).logits
        loss = self._loss(logits, targets, labels, num_items_in_batch)
        if self.router is None or not self.router.logits or (targets is None and labels is None):
            return loss
        stand_in = logits.new_zeros(1, 1, self.config.get_text_config().hidden_size)
        return loss + self._router_loss(stand_in, tuple(self.router.logits))

    def decode_cache(self, pad: list[int], capacity: int) -> HFCache:
        """An empty cache for rows left-padded by `pad` positions, to hold `capacity` positions."""
        embedding = self.hf_model.get_input_embeddings()
        limit = position_limit(self.hf_model, self.config, embedding, self.blocks)
        check_positions(limit, capacity, type(self.hf_model).__name__)
        return HFCache(self.config, pad, capacity)

    def decode(self, input_ids: torch.Tensor, cache: HFCache) -> torch.Tensor:
        """The logits (B, 1, V) of each row's last position after `input_ids`, the tokens that
        follow the cached ones: the model's own forward, the cache passed to every layer."""
        mask, positions = cache.advance(input_ids.shape[1], input_ids.device)
        if self.router is not None:
            self.router.start(mask)
        keywords = cache.keywords(self.hf_model, mask, positions)
        return self.hf_model(input_ids=input_ids, **keywords, **self.quiet).logits[:, -1:]

    def _router_loss(
        self, hidden: torch.Tensor, router_logits: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """`router_aux_loss_coef * aux_loss` exactly as the model's own forward adds it to its loss
        (which coefficient, which load-balancing loss, the attention mask): the forward runs on
        the collected router logits with a loss function that returns zero for the cross-entropy,
        so what it returns as its loss is `0 + coef * aux` (`tierzero.hf.router`). `hidden` is
        a stand-in the head turns into one token's logits, which nothing uses."""
        assert self.router is not None
        zero = hidden.new_zeros((), dtype=torch.float32)
        keep = (
            {"logits_to_keep": 1}
            if "logits_to_keep" in inspect.signature(self.hf_model.forward).parameters
            else {}
        )
        with _returning(self.base, hidden, router_logits), _loss_function(self.hf_model, zero):
            out = self.hf_model(
                inputs_embeds=hidden,
                attention_mask=self.router.attention_mask,
                use_cache=False,
                labels=torch.zeros(1, 1, dtype=torch.long, device=hidden.device),
                output_router_logits=True,
                **keep,
            )
        return out.loss

    def _loss(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor | None,
        labels: torch.Tensor | None,
        num_items_in_batch: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        if targets is None and labels is None:
            return logits
        # the model's own loss; ForCausalLMLoss takes shift_labels as they are (no second shift),
        # and divides its summed token losses by num_items_in_batch where given (else their mean)
        shifted = None if targets is None else targets.contiguous()
        return self.hf_model.loss_function(
            logits=logits,
            labels=labels,
            shift_labels=shifted,
            vocab_size=self.config.vocab_size,
            num_items_in_batch=num_items_in_batch,
        )

    # -- init -----------------------------------------------------------------------------------

    def unit_kinds(self) -> list[int | str]:
        """What `init_unit` takes for each unit: the units outside the blocks, then each block."""
        return [*self.OUTSIDE, *range(len(self.blocks))]

    def unit_modules(self, which: int | str) -> tuple[int, list[nn.Module]]:
        """Unit `which`'s index and modules: block `which` (an index), "embedding", "head" or
        "root" (everything outside the blocks). A tied output layer is the embedding's."""
        n = len(self.blocks)
        blocks = {id(m) for m in self.blocks.modules()}
        embedding = self.embedding_modules()
        if which == "root":
            return 0, [m for m in self.hf_model.modules() if id(m) not in blocks]
        if which == "embedding":
            return 0, embedding
        if which == "head":
            skip = blocks | {id(m) for m in embedding}
            output = self.hf_model.get_output_embeddings()
            if output is not None and output.weight is self.hf_model.get_input_embeddings().weight:
                skip.add(id(output))
            return n + 1, [m for m in self.hf_model.modules() if id(m) not in skip]
        return int(which) + 1, list(self.blocks[int(which)].modules())

    def embedding_modules(self) -> list[nn.Module]:
        return list(self.get_input_embeddings().modules())

    def init_unit(self, seed: int, which: int | str) -> None:
        """Initialise one unit (`unit_modules`) with the model's own `_init_weights` (LlamaRMSNorm
        has no `reset_parameters`; Linear/Embedding get the config's `initializer_range`), under
        a seed that depends only on (seed, unit)."""
        unit_id, modules = self.unit_modules(which)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(unit_seed(seed, unit_id))
            self.init_modules(modules)

    def init_modules(self, modules: list[nn.Module]) -> None:
        for module in reversed(modules):  # children before parents, as nn.Module.apply does
            self.hf_model._init_weights(module)


class SplitCausalLM(CausalLM):
    """The split layout: the final norm and the output layer run in `head_out`, the head unit;
    position tables that run before the blocks are the embedding unit's (`tierzero.hf.prelude`)."""

    OUTSIDE = ("embedding", "head")

    def __init__(
        self,
        hf_model: nn.Module,
        blocks: str,
        base: nn.Module,
        final_norm: nn.Module | None,
        tables: list[nn.Module] | None = None,
    ) -> None:
        super().__init__(hf_model, blocks)
        self.loss_chunk_bytes = loss_chunk_bytes(hf_model.config.vocab_size)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "final_norm", final_norm)  # None: it has no parameters (OLMo's)
        prelude = (
            Prelude(hf_model.get_input_embeddings(), tables, self._prelude) if tables else None
        )
        object.__setattr__(self, "prelude", prelude)
        inside = {id(m) for m in self.blocks.modules()}
        object.__setattr__(
            self,
            "dropouts",
            [m for m in hf_model.modules() if isinstance(m, nn.Dropout) and id(m) not in inside],
        )
        self.layers_as_tuple: bool | None = None  # how its layers return (`layer_calls` finds out)

    def get_input_embeddings(self) -> nn.Module:
        """The embedding unit's entry: the input embedding, or the prelude holding it."""
        return self.prelude if self.prelude is not None else self.hf_model.get_input_embeddings()

    def embedding_modules(self) -> list[nn.Module]:
        return self.prelude.parts() if self.prelude is not None else super().embedding_modules()

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
        cache: HFCache | None = None,
    ) -> Any:
        if cache is not None:
            return self.decode(input_ids, cache)
        if self.router is not None:
            self.router.start(attention_mask)
        with contextlib.ExitStack() as stack:
            if self.prelude is not None:
                first = self.prelude(input_ids, attention_mask)  # the embedding unit
                stack.enter_context(replaying(self.blocks[0], first, self.prelude, self.dropouts))
            stack.enter_context(_deferred(self.final_norm, self.blocks[-1]))
            hidden = self.base(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **self.quiet
            )
        # None: no MoE layer ran
        logits = tuple(self.router.logits) or None if self.router is not None else None
        return self.head_out(
            hidden.last_hidden_state,
            targets,
            labels=labels,
            router_logits=logits,
            num_items_in_batch=num_items_in_batch,
        )

    def decode(self, input_ids: torch.Tensor, cache: HFCache) -> torch.Tensor:
        """`CausalLM.decode` through the units: the embedding (with the positions of the tokens
        that follow the cached ones), the layers with the cache, the head on the last position."""
        mask, positions = cache.advance(input_ids.shape[1], input_ids.device)
        if self.router is not None:
            self.router.start(mask)
        with contextlib.ExitStack() as stack:
            if self.prelude is not None:
                first = self.prelude(input_ids, mask, positions)  # the embedding unit
                stack.enter_context(replaying(self.blocks[0], first, self.prelude, self.dropouts))
            stack.enter_context(_deferred(self.final_norm, self.blocks[-1]))
            keywords = cache.keywords(self.base, mask, positions)
            hidden = self.base(input_ids=input_ids, **keywords, **self.quiet)
        return self.head_out(hidden.last_hidden_state[:, -1:])

    def _prelude(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The base model's own forward up to its first block: the hidden state it gets (a
        decoding pass gives the position ids of tokens that follow cached ones)."""
        positions = {} if position_ids is None else {"position_ids": position_ids}
        with stop_at(self.blocks[0]) as until_block:
            return until_block(
                lambda: self.base(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **positions
                )
            )

    def first_hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden state the first layer gets (the embedding unit's part of the forward)."""
        return self._prelude(input_ids, None)

    def layer_calls_refusal(self) -> str | None:
        """Why `layer_calls` cannot give the head unit the hidden state the model's forward
        does."""
        if self.final_norm is None:
            return (
                f"{type(self.hf_model).__name__}'s final norm has no parameters, so it runs "
                "inside the model's forward rather than in the head unit"
            )
        if self.router is not None:
            return (
                "its router aux loss reads every layer's router logits from one forward of the "
                "micro-batch, which the schedule does not carry from unit to unit"
            )
        return None

    def layer_calls(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[LayerCall]]:
        """The first layer's hidden input and every layer's call, from the base model's own
        forward with the layers recording (`tierzero.hf.layercalls`) and the final norm deferred."""
        # layers returning the hidden state, or a tuple of it first: each try draws the same dropout
        modes = (False, True) if self.layers_as_tuple is None else (self.layers_as_tuple,)
        for as_tuple in modes:
            with (
                torch.random.fork_rng(devices=[input_ids.device] if input_ids.is_cuda else []),
                recording(self.blocks, as_tuple) as calls,
                _deferred(self.final_norm, self.blocks[-1]),
            ):
                out = self.base(input_ids=input_ids, use_cache=False)
            if chained(calls, len(self.blocks), out.last_hidden_state):
                self.layers_as_tuple = as_tuple
                return calls[0].hidden, calls
        refuse_unchained(type(self.hf_model).__name__)

    def head_out(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        router_logits: tuple[torch.Tensor, ...] | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
    ) -> Any:
        """Final norm, the model's own head and loss: everything after the blocks (a
        Mixture-of-Experts model's router aux loss too, from `router_logits`: the head unit's
        inputs, so its gradient reaches every block's router through the engine).

        With shifted `targets`, in chunks of about `loss_chunk_bytes` of fp32 logits, as the
        built-in model does (`tierzero.models.loss`): each chunk's logits come from the model's
        own head and its `loss_function` sums them over the whole batch's token count, under
        activation checkpointing, so one chunk's logits exist at a time. One chunk (a small
        vocabulary or batch) is the unchunked loss bitwise; several differ by summation order.
        `num_items_in_batch` replaces the batch's own count (`tierzero.models.loss`)."""
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        chunk = chunk_tokens_for(self.config.vocab_size, self.loss_chunk_bytes)
        if targets is None or labels is not None or targets.numel() <= chunk:
            loss = self._loss(self._logits(hidden), targets, labels, num_items_in_batch)
        else:
            h, t = hidden.reshape(1, -1, hidden.shape[-1]), targets.reshape(1, -1)
            count = (
                (t != IGNORE_INDEX).sum().clamp(min=1)
                if num_items_in_batch is None
                else num_items_in_batch
            )
            parts = [
                checkpoint(
                    self._chunk_loss,
                    h[:, a : a + chunk],
                    t[:, a : a + chunk],
                    count,
                    use_reentrant=False,
                )
                for a in range(0, t.shape[1], chunk)
            ]
            loss = functools.reduce(operator.add, parts)
        if router_logits is None or (targets is None and labels is None):
            return loss
        return loss + self._router_loss(hidden.new_zeros(1, 1, hidden.shape[-1]), router_logits)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own head (logit scaling and soft-capping included) on `hidden`."""
        with _returning(self.base, hidden):
            return self.hf_model(inputs_embeds=hidden, use_cache=False, **self.quiet).logits

    def _chunk_loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        return self.hf_model.loss_function(
            logits=self._logits(hidden),
            labels=None,
            shift_labels=targets.contiguous(),
            vocab_size=self.config.vocab_size,
            num_items_in_batch=count,
        )


@contextlib.contextmanager
def _deferred(module: nn.Module | None, last_block: nn.Module) -> Iterator[None]:
    """`module` passes its input through while the base model runs (head_out applies it); it
    must run after `last_block` (else it is no final norm: refused, not trained wrongly)."""
    if module is None:
        yield
        return
    called: list[bool] = []

    def deferred(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not called:
            raise ConfigError(
                f"{type(module).__name__} runs before the model's last block, so it is not a "
                "final norm tierzero can run in the head unit; report this model"
            )
        return x

    handle = last_block.register_forward_pre_hook(lambda *_: called.append(True))
    module.forward = deferred
    try:
        yield
    finally:
        handle.remove()
        del module.forward


@contextlib.contextmanager
def _returning(
    base: nn.Module, hidden: torch.Tensor, router_logits: tuple[torch.Tensor, ...] | None = None
) -> Iterator[None]:
    """The base model returns `hidden` as its last hidden state (and a Mixture-of-Experts base
    `router_logits`), without computing anything."""
    from transformers.modeling_outputs import (
        BaseModelOutputWithPastAndCrossAttentions,
        MoeModelOutputWithPast,
    )

    if routes(base):  # every field an MoE head reads
        outputs: Any = MoeModelOutputWithPast(last_hidden_state=hidden, router_logits=router_logits)
    else:  # every field a head reads
        outputs = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden)
    base.forward = lambda *args, **kwargs: outputs
    try:
        yield
    finally:
        del base.forward


@contextlib.contextmanager
def _loss_function(hf_model: nn.Module, value: torch.Tensor) -> Iterator[None]:
    """The model's `loss_function` returns `value` (a fresh tensor) whatever it is given."""
    before = hf_model.__dict__.get("_loss_function")
    hf_model.loss_function = lambda *args, **kwargs: value.clone()
    try:
        yield
    finally:
        if before is None:
            del hf_model._loss_function
        else:
            hf_model._loss_function = before
