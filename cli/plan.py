"""`tierzero plan`: the memory ledger of a model on a machine, and where its state should live."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.markup import escape
from rich.table import Table
from tierzero.cli import plan_options as opt
from tierzero.cli.output import Output

from tierzero.config import Evaluation, RunConfig, StateKind, Tier
from tierzero.hf.lora import LoraSpec
from tierzero.hf.plan import plan as plan_model
from tierzero.planning.ledger import GB
from tierzero.planning.peaks import MemoryModel, format_bytes, format_count
from tierzero.planning.placement import Link
from tierzero.planning.report import PlanReport
from tierzero.planning.streaming import DEFAULT
from tierzero.planning.wear import WEAR_NOTE_FRACTION, DriveWear


def plan(
    model: opt.Model = None,
    params: opt.Params = None,
    gpus: opt.Gpus = None,
    gpu_mem: opt.GpuMem = None,
    host_mem: opt.HostMem = None,
    nvme_free: opt.NvmeFree = None,
    nvme_path: opt.NvmePath = Path("."),
    batch_size: opt.BatchSize = None,
    seq_len: opt.SeqLen = None,
    prefetch_depth: opt.PrefetchDepth = None,
    dtype: opt.Dtype = None,
    vocab_size: opt.VocabSize = None,
    piece_numel: opt.PieceNumel = None,
    overlap: opt.Overlap = True,
    profile: opt.Profile = None,
    stage: opt.Stage = None,
    accumulate: opt.Accumulate = 1,
    schedule: opt.Schedule = "auto",
    recompute: opt.Recompute = "auto",
    optimizer_device: opt.OptimizerDevice = "auto",
    optimizer_state: opt.OptimizerState = "fp32",
    master: opt.Master = "fp32",
    lora_r: opt.LoraR = None,
    lora_targets: opt.LoraTargets = None,
    quantize_base: opt.QuantizeBase = "none",
    steps: opt.Steps = RunConfig.steps,
    checkpoint_every: opt.CheckpointEvery = None,
    drive_tbw: opt.DriveTbw = None,
    eval_tokens: opt.EvalTokens = Evaluation.eval_tokens,
    json_out: opt.Json = False,
) -> None:
    """Print the 16-byte ledger per GPU (DDP, ZeRO 1-3), its compact rows (the state's bytes per
    parameter for each --optimizer-state and --master), the ZeRO stage (--gpus > 1) and its
    offload placements, the activation memory, which placement fits this machine, and its peak
    in every tier, part by part.

    Model shapes: a preset (--model; the LLaMA-3 shapes are llama3-8b and llama3-70b), a
    parameter count shaped like the nearest preset (--params), --vocab-size to change a
    shape's vocabulary, or hf:DIR (--model), a Hugging Face directory's own model, with
    --lora-r its adapters on a frozen base (--quantize-base nf4: that base in 4 bits). Sizes
    not given are what `tierzero train` would take on this machine."""
    options = dict(locals())  # every other option is `tierzero.plan`'s keyword of its name
    json_out, lora_r, targets = (options.pop(k) for k in ("json_out", "lora_r", "lora_targets"))
    lora = None
    if lora_r is not None:
        names = tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else None
        lora = LoraSpec(lora_r, float(lora_r), 0.0, names)
    report = plan_model(lora=lora, **options)
    out = Output(json_out)
    if json_out:
        out.emit_json(report.as_dict())
        return
    _print_report(out, report)


# Plan's output fits an 80-column terminal: free text wraps at the console's width (the other
# commands print unwrapped lines), tables use one size unit for every cell and two-line headers.
_LINK_HEADERS = {
    Link.NVME_TO_HOST: "nvme\nread",
    Link.HOST_TO_NVME: "nvme\nwrite",
    Link.HOST_TO_GPU: "h2d",
    Link.GPU_TO_HOST: "d2h",
}
_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3), ("B", 1))


def _say(out: Output, text: str) -> None:
    out.print(text, soft_wrap=False, highlight=False)


def _unit(largest: float) -> tuple[str, int]:
    """A table's one unit: the largest in which `largest` bytes is at least 10, so the table's
    smaller figures keep two significant digits (`1360` GB, not `1.36` TB beside `0.02`)."""
    return next((u for u in _UNITS if largest >= 10 * u[1]), _UNITS[-1])


def _cell(nbytes: float, scale: int) -> str:
    """At most five characters: `0`, `<0.01`, `0.25`, `12.5`, `512`, `9999`."""
    return _figure(nbytes / scale)


def _figure(v: float) -> str:
    if v == 0:
        return "0"
    if v < 0.01:
        return "<0.01"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _print_report(out: Output, report: PlanReport) -> None:
    """The plan, section by section, in the order of its JSON object."""
    r = report.as_dict()
    _print_model(out, report, r)
    _print_formats(out, r)
    _print_activations(out, report)
    if report.gpus > 1:
        st = r["stage"]
        _say(out, f"ZeRO stage {st['stage']} ({st['reason']}): {st['text']}")
    _print_placements(out, report)
    _print_choice(out, report)
    _print_traffic(out, r)
    _print_wear(out, report)
    _print_recompute(out, r)
    _say(out, f"Optimizer: steps {r['optimizer']['why']}")
    _say(out, "Peak per tier, part by part (the phase where each part peaks):")
    _print_peaks(out, report.choice.estimate.memory)
    if report.gpus > 1:
        _print_per_rank(out, report, r["per_rank"])


def _print_model(out: Output, report: PlanReport, r: dict) -> None:
    """The model, its compute dtype, the base's storage when coded, and the ledger table."""
    m = r["model"]
    what = (
        escape(m["preset"])
        if m["preset"]
        else f"{format_count(m['params'])} params shaped like {m['shape']}"
    )
    _say(
        out,
        f"[bold]tierzero plan[/] {what}: {format_count(m['params'])} params in {m['units']} units "
        f"(largest {format_count(m['largest_unit_params'])}), {report.gpus} GPU(s), {r['dtype']}",
    )
    _say(out, f"Compute dtype: {r['dtype']} ({_DTYPE_SOURCES[report.precision.source]})")
    if r["base"]["quantize_base"] != "none":
        _say(out, f"Base: {r['base']['text']}")
    basis = "nominal size" if m["ledger_params"] != m["params"] else "exact size"
    t = Table(
        title=f"Training state per GPU ({basis}: {format_count(m['ledger_params'])} params)",
        box=box.SIMPLE_HEAD,
    )
    for col in ("stage", "bytes/param", "per GPU", f"per GPU (exact {format_count(m['params'])})"):
        t.add_column(col, justify="right" if col != "stage" else "left", no_wrap=True)
    for row in r["ledger"]:
        t.add_row(
            row["stage"],
            f"{row['bytes_per_param']:g}",
            format_bytes(round(row["gb_per_gpu"] * GB)),
            format_bytes(round(row["exact_gb_per_gpu"] * GB)),
        )
    out.print(t)


def _print_activations(out: Output, report: PlanReport) -> None:
    act = report.activations
    _say(
        out,
        f"Activations per GPU: {format_bytes(act.total_bytes)} (batch {act.batch_size} x seq "
        f"{act.seq_len}, per-unit checkpointing, loss in chunks of {act.chunk_tokens} tokens) = "
        f"checkpoints {format_bytes(act.checkpoints_bytes)} + max(block backward "
        f"{format_bytes(act.block_backward_bytes)}, head backward "
        f"{format_bytes(act.head_backward_bytes)})",
    )


def _print_choice(out: Output, report: PlanReport) -> None:
    """The machine, whether the chosen placement fits it, and the streaming settings if not
    the defaults."""
    sizes = [f"{t.value} {format_bytes(b)}" for t, b in report.budgets.items() if b is not None]
    detected = report.machine.detected
    found = f" (detected: {', '.join(detected)})" if detected else ""
    _say(out, f"Machine: {', '.join(sizes)}{found}")
    choice = report.choice
    if choice.fits:
        _say(out, f"[bold green]fits:[/] {choice.placement.describe()}")
    else:
        _say(out, f"[bold red]does not fit:[/] {choice.shortfall}")
    if report.streaming != DEFAULT:
        why = "chosen: the defaults do not fit" if report.chosen else "as given"
        _say(out, f"Streaming: {report.streaming.describe()} ({why})")


def _print_traffic(out: Output, r: dict) -> None:
    """The NVMe bytes of a step under the schedule run (and the other), and of an evaluation."""
    sched, moved = r["schedule"], r["schedule"]["nvme_bytes_per_step"]
    other = "horizontal" if sched["schedule"] == "vertical" else "vertical"
    _say(
        out,
        f"Schedule: {sched['schedule']}, {sched['accumulate']} micro-batch(es) per step: NVMe "
        f"{format_bytes(moved[sched['schedule']])} per step ({other}: "
        f"{format_bytes(moved[other])})",
    )
    ev = r["evaluation"]
    _say(
        out,
        f"Evaluation: NVMe {format_bytes(ev['nvme_read_bytes'])} read per evaluation of "
        f"{ev['windows']} windows, every unit once (window by window: "
        f"{format_bytes(ev['per_window_nvme_read_bytes'])})",
    )


def _print_recompute(out: Output, r: dict) -> None:
    rc = r["recompute"]
    head = " and the head" if rc["kept_head"] else ""
    graphs = rc["graphs_per_block"]
    per_micro = f" for its {graphs} micro-batches' graphs" if graphs > 1 else ""
    sized = (
        "; estimated from the shape: the engine measures each unit's at its first step"
        if rc["sized_by"] != "the shape"
        else ""
    )
    _say(
        out,
        f"Recompute: {rc['recompute']}: {rc['kept_blocks']} blocks{head} of "
        f"{rc['keepable_units']} units that can keep their activations do "
        f"({format_bytes(rc['kept_bytes'])} beyond the peak below; a block "
        f"{format_bytes(rc['bytes_per_block'])}{per_micro}, the head "
        f"{format_bytes(rc['head_bytes'])}{sized}); the other units run their forward again in "
        "backward",
    )


def _print_per_rank(out: Output, report: PlanReport, rank: dict) -> None:
    budget = (
        ""
        if rank["host_budget_bytes"] is None
        else f" (its host budget: {format_bytes(rank['host_budget_bytes'])})"
    )
    _say(
        out,
        f"Per rank, 1 of {report.gpus} on this machine{budget}; the ranks share the machine's "
        "drives, so nvme traffic above is all ranks' on one bandwidth:",
    )
    _print_peaks(out, report.choice.estimate.memory.per_rank())


_DTYPE_SOURCES = {
    "dtype": "--dtype",
    "gpus": "assumed for --gpus: bf16 GPUs; --dtype to change",
    "train": "`tierzero train`'s default here; --dtype to change",
}


def _print_wear(out: Output, report: PlanReport) -> None:
    """The NVMe bytes written per step and per run (checkpoints included), and with
    --drive-tbw the share of the drive's rating they use: a note above `WEAR_NOTE_FRACTION`."""
    wear = report.wear
    _say(
        out,
        f"NVMe writes: {format_bytes(round(wear.per_step_bytes))} per step, "
        f"{format_bytes(wear.run_bytes)} over {wear.steps} steps (with {wear.checkpoints} "
        f"checkpoint(s): {format_bytes(wear.checkpoint_bytes)})",
    )
    for line in wear_lines(wear):
        _say(out, line)


def wear_lines(wear: DriveWear) -> list[str]:
    """With a drive rating: the share of it the run writes, and a note above `WEAR_NOTE_FRACTION`
    (`tierzero plan` and `tierzero train` say it alike)."""
    if wear.rating_fraction is None or wear.per_1000_steps_fraction is None:
        return []
    lines = [
        (
            f"Drive wear: {_percent(wear.rating_fraction)} of a {wear.drive_tbw:g} TBW drive's "
            f"rating, {_percent(wear.per_1000_steps_fraction)} per 1000 steps"
        )
    ]
    if wear.over_note:
        lines.append(
            f"[yellow]note:[/] this run writes {_percent(wear.rating_fraction)} of the drive's "
            f"rated endurance (over {_percent(WEAR_NOTE_FRACTION)} for one run); compact state "
            "(--optimizer-state int8, --master bf16) or more host memory writes less"
        )
    return lines


def _percent(fraction: float) -> str:
    """`12.3%`, `0.85%`, `0.0042%`: at least two significant digits."""
    value = 100 * fraction
    return f"{value:.3g}%" if value >= 0.001 or value == 0 else f"{value:.1e}%"


def _print_formats(out: Output, r: dict) -> None:
    """The compact rows: bytes per parameter of the state on one rank for each
    (--optimizer-state, --master), the chosen one marked."""
    t = Table(
        title=f"State bytes per parameter by format ({r['dtype']} compute; grads in it, as above)",
        box=box.SIMPLE_HEAD,
    )
    for col in ("--optimizer-state", "--master", "weights", "grads", "moments", "total", ""):
        t.add_column(
            col, justify="left" if col.startswith("--") or not col else "right", no_wrap=True
        )
    for row in r["compact_ledger"]:
        t.add_row(
            row["optimizer_state"],
            row["master"],
            *(f"{row[k]:.2f}" for k in ("weights", "grads", "moments", "bytes_per_param")),
            "<" if row["chosen"] else "",
        )
    out.print(t)
    _say(out, f"State: {r['state_formats']['text']}; homes: {r['homes']['text']}")


def _print_placements(out: Output, report: PlanReport) -> None:
    """Every candidate: its peak per tier (gpu per GPU, the rest per machine) and what it moves
    per step, in one unit; a tier over its budget is named in `fits`."""
    estimates = report.estimates
    step_col = estimates[0].predicted_step_s is not None
    largest = max(max(e.resident_bytes.values()) for e in estimates)
    largest = max(largest, max(max(e.moved_bytes.values()) for e in estimates))
    unit, scale = _unit(largest)
    _say(
        out,
        f"Stage-{report.stage} placements, in {unit}: peak per tier (gpu per GPU, the rest per "
        "machine) and bytes moved per step",
    )
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    t.add_column("param/grad/opt", no_wrap=True)
    for col in (
        *(tier.value for tier in Tier),
        *_LINK_HEADERS.values(),
        *(["step\ns"] if step_col else []),
    ):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("fits", overflow="fold")
    for e in estimates:
        over = e.overflow_bytes(report.budgets)
        t.add_row(
            "/".join(
                e.placement.home(k).value
                for k in (StateKind.PARAM, StateKind.GRAD, StateKind.MASTER)
            ),
            *(_cell(e.resident_bytes[tier], scale) for tier in Tier),
            *(_cell(e.moved_bytes[link], scale) for link in _LINK_HEADERS),
            *([_figure(e.predicted_step_s)] if step_col else []),
            "[green]yes[/]" if not over else f"[red]no: {'+'.join(tier.value for tier in over)}[/]",
        )
    out.print(t)


def _print_peaks(out: Output, memory: MemoryModel) -> None:
    """Each tier's peak, then its parts one per line."""
    for tier in Tier:
        peak = memory.tiers[tier]
        note = (
            " (on the CPU device: host memory)"
            if tier is Tier.GPU and memory.device == "cpu"
            else ""
        )
        _say(out, f"  {tier.value} {format_bytes(peak.peak_bytes)}{note}")
        for term in peak.terms():
            _say(out, f"    {term}")
    if memory.device == "cpu":
        _say(
            out,
            f"  host memory {format_bytes(memory.host_total_bytes)}: the host and gpu tiers, "
            "both in RAM",
        )
