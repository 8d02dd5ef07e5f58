"""`gptkit train`: resolve the run config, show what it will cost, then train on DeepSpeed (or launch the processes
that do)."""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, List, Optional

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from gptkit.config.run import RunConfig
from gptkit.train.launch import DEFAULT_PORT, Launch, emit as emit_job
from gptkit_cli import format as fmt
from gptkit_cli.app import app, flag, handles_errors, out
from gptkit_cli.launch import train_argv

if TYPE_CHECKING:
    from gptkit.train.run import TrainRequest

# Keys that have their own flag; the rest are set with --set section.key=value
FLAGS = {'data.prefix': '--data', 'data.train_prefix': '--train-data', 'data.valid_prefix': '--valid-data',
         'data.test_prefix': '--test-data', 'data.tokenizer': '--tokenizer', 'train.iters': '--iters',
         'train.tokens': '--tokens', 'train.save_interval_minutes': '--save-interval-minutes',
         'train.watchdog_minutes': '--watchdog-minutes',
         'out': '--out', 'preset': '--preset', 'config': '--config', 'set': '--set', 'parallel.tp': '--tp',
         'parallel.pp': '--pp', 'init': '--init'}


def key_name(key: str) -> str:
    "How a config key is shown to a `gptkit train` user"
    return FLAGS.get(key, f'--set {key}' if '.' in key else flag(key))


def request_of(preset, config, sets, **flags) -> TrainRequest:
    "The `TrainRequest` of these flags (gptkit.train.run), with `gptkit train`'s names for them"
    from gptkit.train.run import TrainRequest
    return TrainRequest(preset=preset, config=config, sets=tuple(sets or ()), **flags)


def _summary(cfg: RunConfig):
    m, t, p, batch = cfg.model, cfg.train, cfg.parallel, cfg.batch
    from gptkit.estimate.sizing import count_params, flops_per_iteration
    params, each = count_params(m).total, fmt.flops(flops_per_iteration(m, batch.global_batch, t.recompute))
    experts = f' (ep {p.ep}: {m.moe_experts // p.ep} of {m.moe_experts} experts per rank)' if p.ep > 1 else ''
    out.print(f'[bold]{fmt.text(cfg.preset or "custom")}[/]: {params:,} parameters ({m.layers} layers, '
              f'hidden {m.hidden}, '
              f'{m.heads} heads, '
              f'context {m.seq_len}, vocabulary {m.vocab:,}) | {t.precision}, ZeRO {p.zero}, recompute {t.recompute} | '
              f'tp {p.tp} x pp {p.pp} x dp {p.dp}{experts} | '
              f'{batch.iters:,} steps of {batch.global_batch} x {m.seq_len} = '
              f'{batch.tokens_per_step:,} tokens ({each} each) | lr {cfg.optim.lr:g} -> {cfg.optim.floor:g} | out '
              f'{fmt.text(cfg.out)}')


def _data_summary(plan):
    "Where the weights come from, and each split's datasets: weight, samples drawn and epochs (or why there are none)"
    if plan.precision_why is not None:
        out.print(fmt.text(plan.precision_why))
    if plan.init_from is not None:
        out.print(f'weights from {fmt.text(plan.init_from)}: step 0, a fresh optimizer and learning-rate schedule')
        m = plan.cfg.model
        if m.positions > m.seq_len:     # an import's capacity is no training length (gptkit.train.plan.INIT_SEQ_LEN)
            out.print(f'trains {m.seq_len:,}-token sequences; the checkpoint holds {m.positions:,} positions '
                      '(model.context), which export keeps; --set model.seq_len=N trains at another length')
    if plan.data_error is not None:
        out.print(f'[yellow]data: {fmt.text(plan.data_error)}[/]')
    for name, parts in plan.data.items():
        for p in parts:
            weight = 'whole' if p.weight is None else f'weight {p.weight:.4g}'
            out.print(f'{name} data: {fmt.text(p.prefix)} | {weight} | {p.samples:,} samples | {p.epochs} epoch'
                      f'{"s" if p.epochs != 1 else ""}')


def _task_summary(cfg: RunConfig):
    "What the loss learns and what attends to what, when it is not plain pre-training"
    from gptkit.train.plan import task_summary
    if (line := task_summary(cfg)) is not None:
        out.print(fmt.text(line))


# The options of `gptkit train`, in the order its --help lists them
PresetOption = Annotated[Optional[str], typer.Option(
    help='Model and recipe: tiny, small, 125m ... 175b, llama-tiny, llama-3.2-1b, llama-3.1-8b, smollm2-135m, '
         'tinyllama-1.1b, qwen2.5-0.5b, qwen3-0.6b, mistral-7b, moe-tiny, mixtral-8x7b, qwen3-30b-a3b, '
         'olmoe-1b-7b '
         '(default tiny when no --config).')]
ConfigOption = Annotated[Optional[Path], typer.Option(
    help='A JSON or YAML run config (sections model, data, parallel, train, optim).')]
SetOption = Annotated[Optional[List[str]], typer.Option(
    '--set', help='Override one setting: section.key=value (repeat).')]
DataOption = Annotated[Optional[str], typer.Option(
    help="Dataset PREFIX (PREFIX.bin/.idx from gptkit data prepare) or a blend '0.3 PREFIX1 0.7 PREFIX2'.")]
TrainDataOption = Annotated[Optional[str], typer.Option(
    help='The train split\'s own PREFIX or blend (instead of --data and data.split).')]
ValidDataOption = Annotated[Optional[str], typer.Option(
    help="The validation split's own PREFIX or blend (with --train-data).")]
TestDataOption = Annotated[Optional[str], typer.Option(
    help="The test split's own PREFIX or blend (with --train-data).")]
TokenizerOption = Annotated[Optional[str], typer.Option(
    help="Tokenizer folder the data was prepared with, or 'gpt2'.")]
OutDirOption = Annotated[Optional[Path], typer.Option(
    '--out', help='Run folder: config, metrics, TensorBoard events, checkpoints.')]
ItersOption = Annotated[Optional[int], typer.Option(help='Optimizer steps.')]
TokensOption = Annotated[Optional[str], typer.Option(
    help='Train on this many tokens instead of --iters (like 300B).')]
TpOption = Annotated[Optional[int], typer.Option(
    help='Tensor-parallel degree (parallel.tp): each layer split over this many processes.')]
PpOption = Annotated[Optional[int], typer.Option(
    help='Pipeline-parallel degree (parallel.pp): the layers split into this many stages.')]
SaveIntervalMinutesOption = Annotated[Optional[float], typer.Option(
    help='Also save when this many minutes passed since the last save (train.save_interval: steps).')]
WatchdogMinutesOption = Annotated[Optional[float], typer.Option(
    help='A step, evaluation or save that takes longer is a hang: print every stack and exit 124 '
         '(train.watchdog_minutes, default 30).')]
MaxRestartsOption = Annotated[int, typer.Option(
    help="Restart all processes up to this many times when one dies or hangs (torchrun's elastic agent); "
         'each restart resumes from the newest intact checkpoint.')]
ResumeOption = Annotated[bool, typer.Option(
    '--resume', help="Continue from the newest intact checkpoint in --out (with neither --preset nor --config: "
                     "the run's own config.json, the other flags on top).")]
InitOption = Annotated[Optional[str], typer.Option(
    '--init', '--init-from',
    help="Start from this checkpoint's weights (a run folder, its checkpoints/ or an iter_ folder; gptkit checkpoint "
         'import writes one) at step 0: a fresh optimizer, this run\'s schedule and data; the model and tokenizer are '
         "the checkpoint's.")]
DryRunOption = Annotated[bool, typer.Option(
    '--dry-run',
    help='Print the resolved config, the DeepSpeed config and the launch command, then stop.')]
DeepspeedConfigOption = Annotated[Optional[Path], typer.Option(
    help='A DeepSpeed JSON merged over the generated one (experts).')]
NprocOption = Annotated[Optional[int], typer.Option(
    help='Start this many processes on this node (on each node) with --launcher.')]
LauncherOption = Annotated[str, typer.Option(help='torchrun or deepspeed, for --nproc and --nnodes.')]
NnodesOption = Annotated[int, typer.Option(help='Nodes the run spans; run the same command on each.')]
NodeRankOption = Annotated[int, typer.Option(help='This node\'s rank, 0 to --nnodes - 1.')]
MasterAddrOption = Annotated[Optional[str], typer.Option(
    help='Address of the node with --node-rank 0 (needed with --nnodes above 1).')]
MasterPortOption = Annotated[Optional[int], typer.Option(
    help='Its port (default: 29500 across nodes, a free one on one node).')]
HostfileOption = Annotated[Optional[Path], typer.Option(
    help="DeepSpeed's hostfile ('host slots=N' lines): deepspeed starts every node itself.")]
EmitOption = Annotated[Optional[str], typer.Option(
    help='Print a job file instead of training: slurm (an sbatch script) or k8s (a Kubeflow PyTorchJob).')]
ImageOption = Annotated[Optional[str], typer.Option(help='The container image, for --emit k8s.')]
ForceOption = Annotated[bool, typer.Option(
    '--force', help="Train even when the estimate says the model does not fit this machine.")]
LocalRankOption = Annotated[Optional[int], typer.Option('--local_rank', '--local-rank', hidden=True)]


@app.command(context_settings={'help_option_names': ['-h', '--help']})
@handles_errors(name=key_name)
def train(
    ctx: typer.Context,
    preset: PresetOption = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    data: DataOption = None,
    train_data: TrainDataOption = None,
    valid_data: ValidDataOption = None,
    test_data: TestDataOption = None,
    tokenizer: TokenizerOption = None,
    out_dir: OutDirOption = None,
    iters: ItersOption = None,
    tokens: TokensOption = None,
    tp: TpOption = None,
    pp: PpOption = None,
    save_interval_minutes: SaveIntervalMinutesOption = None,
    watchdog_minutes: WatchdogMinutesOption = None,
    max_restarts: MaxRestartsOption = 0,
    resume: ResumeOption = False,
    init: InitOption = None,
    dry_run: DryRunOption = False,
    deepspeed_config: DeepspeedConfigOption = None,
    nproc: NprocOption = None,
    launcher: LauncherOption = 'torchrun',
    nnodes: NnodesOption = 1,
    node_rank: NodeRankOption = 0,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    hostfile: HostfileOption = None,
    emit: EmitOption = None,
    image: ImageOption = None,
    force: ForceOption = False,
    local_rank: LocalRankOption = None,
):
    """Train a GPT on DeepSpeed: one process here, or --nproc processes through torchrun or deepspeed.

    SIGINT, SIGTERM or SIGUSR1 (a scheduler's preemption, SLURM's --signal=USR1@120) finish the step, save a
    checkpoint and exit with 128 + the signal's number (130, 143, 138); --resume continues from it. A hang
    exits 124 after --watchdog-minutes; --max-restarts K restarts a run whose process died or hung."""
    launch = Launch(launcher=launcher, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                    master_port=master_port, hostfile=hostfile, max_restarts=max_restarts)
    mode = 'emit' if emit is not None else 'dry-run' if dry_run else 'train'
    request = request_of(preset, config, set_, data=data, splits=(train_data, valid_data, test_data),
                         tokenizer=tokenizer, out=out_dir, iters=iters, tokens=tokens, tp=tp, pp=pp,
                         save_minutes=save_interval_minutes, watchdog_minutes=watchdog_minutes, resume=resume,
                         init=init, deepspeed_config=deepspeed_config, launch=launch, nproc=nproc,
                         argv=tuple(train_argv(ctx)), mode=mode, force=force,
                         launched='RANK' in os.environ or local_rank is not None)
    from gptkit.train.run import plan_train, run_plan
    plan = plan_train(request)                                       # once, checked, before any process starts
    if emit is not None:
        return print(emit_job(emit, plan.launch, list(request.argv), plan.cfg.out, image), end='')
    if dry_run:
        return _dry_run(plan, request)
    return _finish(plan, request, run_plan(plan, request, callbacks=[RichProgress()], say=_say, show=_show))


def _say(line: str):
    out.print(f'[dim]{fmt.text(line)}[/]')


def _show(plan, request):
    "What this process is about to train, said by rank 0 (a restart says why it resumes)"
    if request.rank != 0:
        return
    if request.restart:
        out.print(f'[yellow]restart {request.restart}[/]: a process died or hung; resuming from the newest intact '
                  'checkpoint')
        return
    _summary(plan.cfg)
    _data_summary(plan)
    _task_summary(plan.cfg)


def _dry_run(plan, request):
    "The plan without its checks (`--dry-run`): the summary, the run config, the DeepSpeed config, the launch command"
    from gptkit.train.plan import curriculum_summary
    cfg, launch, world = plan.cfg, plan.launch, plan.cfg.parallel.world_size
    _summary(cfg)
    _data_summary(plan)
    _task_summary(cfg)
    if (line := curriculum_summary(cfg)) is not None:
        out.print(line, markup=False)
    out.print('[bold]Run config[/]')
    out.print_json(json.dumps(cfg.to_dict()))
    out.print(f'[bold]DeepSpeed config[/] for {world} process(es)')
    from gptkit.train.ds_config import ds_config
    out.print_json(json.dumps(ds_config(cfg, override=plan.ds_override)))
    argv = list(request.argv)
    cmd = (launch.command(argv, launch.master_port or DEFAULT_PORT) if world > 1 or launch.max_restarts
           else ['gptkit', 'train'] + argv)
    out.print('[bold]Launch command[/]')
    out.print(shlex.join(cmd), soft_wrap=True, markup=False)


def predicted_line(info, measured: float) -> str:
    "The first report's measured step beside the performance model's on this device's profile (estimate.calibrate)"
    from gptkit.errors import GptkitError
    from gptkit.estimate.calibrate import machine_profile, predicted_step
    try:
        name = 'cpu'
        if info.device.startswith('cuda'):
            import torch
            name = torch.cuda.get_device_name(info.device)
        gpu = machine_profile(name)
        if gpu is None:
            return f'[dim]step time: {measured * 1e3:,.1f} ms measured; no hardware profile matches {fmt.text(name)} '\
                   '(GPTKIT_HARDWARE, GPTKIT_GPU)[/]'
        predicted = predicted_step(info.cfg, info.world_size, gpu).total
    except GptkitError as e:
        return f'[yellow]step time: {measured * 1e3:,.1f} ms measured; no prediction[/]: {fmt.text(str(e))}'
    except Exception as e:         # a prediction is a courtesy: whatever fails in it, the run trains on
        return (f'[yellow]step time: {measured * 1e3:,.1f} ms measured; no prediction[/] (the performance model '
                f'failed on this run: {fmt.text(type(e).__name__)})')
    return (f'step time: {measured * 1e3:,.1f} ms measured (the first report holds the warm-up), '
            f'{predicted * 1e3:,.1f} ms predicted on {fmt.text(gpu.name)} ({predicted / measured:.2f} x); fit the '
            'profile with gptkit estimate --calibrate RUN')


class RichProgress:
    "A rich progress bar with loss, tokens/s and ETA; evaluations and checkpoints as lines above it"
    def __init__(self):
        self.live = out.is_terminal     # a log file or a pipe gets each report as one whole line, as Megatron's logs
        self.progress = Progress(TextColumn('[bold]train[/]'), BarColumn(), MofNCompleteColumn(),
                                 TextColumn('{task.fields[stats]}'),
                                 TimeElapsedColumn(), TextColumn('ETA'), TimeRemainingColumn(), console=out,
                                 transient=False)

    def on_start(self, info):
        self.info, self.first = info, True
        if self.live:
            self.progress.start()
        self.task = self.progress.add_task('train', total=info.iters, completed=info.start, stats='')
        if info.resumed_from:
            self.progress.console.print(f'resumed from {fmt.text(info.resumed_from)} (step {info.start})')

    def on_step(self, m):
        loss = 'no loss (NaN)' if m.loss is None else f'loss {m.loss:.3f}'
        stats = f'{loss} | lr {m.lr:.2e} | {m.tokens_per_s:,.0f} tok/s | {m.tflops:.3f} TFLOP/s'
        if m.mfu is not None:
            stats += f' | MFU {m.mfu:.1%}'
        if m.grad_norm is not None:
            stats += f' | grad {m.grad_norm:.2f}'
        if m.loss_scale is not None:
            stats += f' | scale {m.loss_scale:g}'
        stats += f' | {m.memory_gib:.1f} GiB'
        self.progress.update(self.task, completed=m.iteration, stats=stats)
        if not self.live:
            self.progress.console.print(self._line(stats), soft_wrap=True, highlight=False, markup=False)
        if self.first:
            self.first = False
            self.progress.console.print(predicted_line(self.info, m.step_seconds), highlight=False)

    def on_eval(self, split, iteration, loss):
        self.progress.console.print(f'step {iteration}: {split} loss {loss:.3f}, perplexity '
                                    f'{math.exp(min(loss, 50)):,.1f}')

    def on_checkpoint(self, path, iteration):
        self.progress.console.print(f'[dim]step {iteration}: checkpoint {fmt.text(path)}[/]')

    def _line(self, stats: str) -> str:
        "The report as one line: step of steps, the stats, time elapsed and ETA (what the live bar shows)"
        task = next(t for t in self.progress.tasks if t.id == self.task)
        eta = '' if task.time_remaining is None else f', ETA {fmt.duration(task.time_remaining)}'
        return (f'train {task.completed:,.0f}/{task.total:,.0f} | {stats} | {fmt.duration(task.elapsed or 0)} '
                f'elapsed{eta}')

    def on_end(self, result):
        if self.live:
            self.progress.stop()


def _finish(plan, request, outcome):
    "How the run ended, said by rank 0: a launcher's exit code passed on, or the result of training here"
    if isinstance(outcome, int):
        raise typer.Exit(outcome)
    result, cfg = outcome, plan.cfg
    if request.rank != 0:
        if result.interrupted:
            raise typer.Exit(result.exit_code)
        return result
    parts = [f'{result.iteration:,} steps, {result.tokens:,} tokens in {fmt.duration(result.seconds)}']
    if result.valid_loss is not None:
        parts.append(f'validation loss {result.valid_loss:.3f}')
    if result.test_loss is not None:
        parts.append(f'test loss {result.test_loss:.3f}')
    out.print('[bold green]done[/]: ' + ', '.join(parts) + f'; checkpoint {fmt.text(result.checkpoint)}')
    if result.interrupted:
        name = signal.Signals(result.signal).name if result.signal else 'a signal'
        out.print(f'[yellow]interrupted[/] by {name}, checkpoint saved: continue with [bold]gptkit train --resume '
                  f'--out {fmt.text(cfg.out)}[/] (its config.json holds the settings; exit code {result.exit_code}: '
                  '128 + the signal)')
        raise typer.Exit(result.exit_code)
    return result
