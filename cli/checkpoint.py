"""`gptkit checkpoint inspect|export|import|reshard`: look inside checkpoints; convert them between formats, layouts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from gptkit.errors import ConfigError
from gptkit_cli.app import app, err, handles_errors, out
from gptkit_cli.format import text

# the Hugging Face families gptkit reads and writes, by model_type, as their model cards name them, in the order of
# gptkit.interop.hf_config (GPT-2, LLAMA_LIKE, MOE_TYPES: tests/test_newcomer_words.py checks; off the start-up path)
FAMILY_NAMES = {'gpt2': 'GPT-2', 'llama': 'Llama', 'mistral': 'Mistral', 'qwen2': 'Qwen2', 'qwen3': 'Qwen3',
                'mixtral': 'Mixtral', 'qwen3_moe': 'Qwen3-MoE', 'olmoe': 'OLMoE'}
FAMILIES = ', '.join(FAMILY_NAMES.values())   # a new family: name it above
checkpoint_app = typer.Typer(help=f'Inspect checkpoints; convert them to and from Hugging Face ({FAMILIES}) and '
                                  'Megatron-LM, and between parallel layouts.',
                             no_args_is_help=True, context_settings={'help_option_names': ['-h', '--help']})
app.add_typer(checkpoint_app, name='checkpoint')
Arg, Opt = typer.Argument, typer.Option
FORMATS = {'hf': 'Hugging Face', 'megatron': 'Megatron-LM legacy'}
EXPORTS = {**FORMATS, 'peft': "peft's LoRA adapters"}   # what export writes: also a LoRA run's adapters alone
CheckpointPath = Annotated[Path, Arg(metavar='PATH',
                                     help='A run folder, its checkpoints/ folder, or one iter_XXXXXXX folder.')]


def _format(value: str, key: str, known: dict = FORMATS) -> str:
    "The format named by --to/--from, or a ConfigError naming the flag"
    if value not in known:
        raise ConfigError([(key, f"{{key}} must be {', '.join(list(known)[:-1])} or {list(known)[-1]}, not {value!r}")])
    return value


def _size(n: int) -> str:
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if n < 1024 or unit == 'GiB':
            return f'{n:,.0f} {unit}' if unit == 'B' else f'{n:,.1f} {unit}'
        n /= 1024


@checkpoint_app.command()
@handles_errors
def inspect(path: CheckpointPath,
            as_json: Annotated[bool, Opt('--json', help='Print everything as one JSON object.')] = False):
    """Config, iteration, tokens seen, parameters, dtypes, parallel layout and files of a checkpoint."""
    from gptkit.checkpoint.checkpointing import inspect as read
    info = read(path)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    m, lay, tok = info['model'], info['layout'], info['tokenizer']
    t = Table(title=text(info['folder']), title_justify='left', show_header=False, box=None, padding=(0, 2))
    t.add_column(style='cyan')
    t.add_column(overflow='fold')   # long paths folded, not cut
    t.add_row('iteration', f"{info['iteration']:,}")
    t.add_row('tokens seen', 'unknown' if info['tokens'] is None else f"{info['tokens']:,}")
    t.add_row('consumed samples', 'unknown' if info['consumed_samples'] is None else f"{info['consumed_samples']:,}")
    t.add_row('parameters',
              f"{info['parameters']:,} ({info['parameters_without_padding']:,} without vocabulary padding)")
    t.add_row('dtype', ', '.join(info['dtypes']))
    t.add_row('model', f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, context {m['seq_len']}, "
                       f"vocabulary {m['vocab']:,}, {m['activation']}")
    t.add_row('layout', f"tp {lay['tp']}, pp {lay['pp']}, ep {lay.get('ep', 1)}, dp {lay['dp']}, ZeRO {lay['zero']}, "
                        f"world size {lay['world_size']}, {lay['precision']}, micro-batch {lay['micro_batch']}, "
                        f"global batch {lay['global_batch']}")
    ex = info.get('experts')
    if ex:
        saved = 'all saved' if ex.get('whole', True) else '[yellow]not all saved[/]'
        t.add_row('experts', f"{ex['experts']} in each of {ex['moe_layers']} MoE layers, top {ex['top_k']}, "
                             f"{ex['expert_parameters']:,} weights; {ex['per_rank']} per rank at ep {ex['ep']}, "
                             f"{saved}")
    t.add_row('tokenizer',
              'none saved' if tok is None else f"{tok['vocab_size']:,} entries, end of document = {tok['eod']}")
    t.add_row('files', f"{len(info['files'])}, {_size(info['bytes'])}")
    if info['stale_temporaries']:
        left = text(', '.join(info['stale_temporaries']))
        t.add_row('[yellow]temporaries[/]', f'{left}: left by a killed run; the next train --resume removes them')
    out.print(t)
    f = Table(box=None, padding=(0, 2))
    f.add_column('file', style='dim')
    f.add_column('size', justify='right')
    for name, size in info['files'].items():
        f.add_row(text(name), _size(size))
    out.print(f)


@checkpoint_app.command()
@handles_errors
def export(path: CheckpointPath,
           out_dir: Annotated[Path, Arg(metavar='OUT', help='The folder to write (new or empty).')],
           to: Annotated[str, Opt('--to', help=f"hf (a transformers folder: {FAMILIES}; a LoRA run's "
                                                "adapters merged), "
                                                "megatron (Megatron-LM's legacy layout) or peft (a LoRA run's "
                                                "adapters alone, as peft's adapter folder).")],
           max_shard_size: Annotated[Optional[str], Opt(help='hf: the most bytes per weights file (5GB when not '
                                                             'given; 500MB, 2GiB or a number of bytes); a bigger '
                                                             'model is written in shards with their index, '
                                                             'model.safetensors.index.json.')] = None):
    """Write a gptkit checkpoint as a Hugging Face folder (its model family's) or a Megatron-LM legacy checkpoint."""
    fmt = _format(to, 'to', EXPORTS)
    if max_shard_size is not None and fmt != 'hf':
        raise ConfigError([('max_shard_size', '{key} is only used with --to hf')])
    from gptkit.interop.hf import export_hf, export_peft
    from gptkit.interop.hf_files import MAX_SHARD_SIZE
    from gptkit.interop.megatron import export_megatron
    most = MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    write = {'hf': lambda: export_hf(path, out_dir, most), 'megatron': lambda: export_megatron(path, out_dir),
             'peft': lambda: export_peft(path, out_dir)}[fmt]
    with err.status(f'exporting {text(path)} to {EXPORTS[fmt]} ...'):
        shown = text(write())
    hint = {'hf': f"load it with AutoModelForCausalLM.from_pretrained('{shown}') and AutoTokenizer",
            'megatron': f'load it in Megatron-LM with --load {shown} --no-load-optim --no-load-rng',
            'peft': f"load it with PeftModel.from_pretrained(base, '{shown}') over the --to hf export of its base"}
    out.print(f'[bold green]exported[/] {text(path)} to {shown} ({EXPORTS[fmt]}); {hint[fmt]}', soft_wrap=True)


@checkpoint_app.command('import')
@handles_errors
def import_(src: Annotated[Path, Arg(metavar='SRC',
                                      help=f'A Hugging Face folder ({FAMILIES}), or a Megatron-LM legacy '
                                           'checkpoint folder.')],
            out_dir: Annotated[Path, Arg(metavar='OUT', help='The gptkit run folder to write (new or empty).')],
            from_: Annotated[str, Opt('--from', help='hf or megatron.')],
            tokenizer: Annotated[Optional[str], Opt(help="megatron: the tokenizer folder (or 'gpt2') "
                                                         "when none is saved beside the checkpoint.")] = None):
    """Turn a Hugging Face or Megatron-LM checkpoint into a gptkit run that trains and generates."""
    fmt = _format(from_, 'from')
    if tokenizer is not None and fmt != 'megatron':
        raise ConfigError([('tokenizer', '{key} is only used with --from megatron')])
    from gptkit.interop.hf import import_hf
    from gptkit.interop.megatron import import_megatron
    with err.status(f'importing {text(src)} from {FORMATS[fmt]} ...'):
        done = import_hf(src, out_dir) if fmt == 'hf' else import_megatron(src, out_dir, tokenizer)
    shown = text(done)
    out.print(f'[bold green]imported[/] {text(src)} into {shown}; continue pre-training from it with '
              f'[bold]gptkit train --init {shown} --data PREFIX --out NEW --iters N[/]', soft_wrap=True)
    from gptkit.checkpoint.checkpointing import read_config
    from gptkit.train.plan import INIT_SEQ_LEN
    m = read_config(done).model
    if m.positions > INIT_SEQ_LEN:     # the capacity is kept; a training length is chosen by the run
        out.print(f'it holds {m.positions:,} positions (model.context, kept by export); train --init trains '
                  f'{INIT_SEQ_LEN:,}-token sequences unless --set model.seq_len=N')



@checkpoint_app.command()
@handles_errors
def reshard(path: CheckpointPath,
            out_dir: Annotated[Path, Arg(metavar='OUT', help='The run folder to write (new or empty).')],
            tp: Annotated[int, Opt(help='Tensor-parallel degree of the new layout.')] = 1,
            pp: Annotated[int, Opt(help='Pipeline-parallel degree of the new layout.')] = 1,
            balance: Annotated[str, Opt(help="Pipeline stages balanced by 'layers' or 'parameters'.")] = 'layers'):
    """Convert a checkpoint of any tensor/pipeline layout into another one (weights, step and data position)."""
    from gptkit.interop.hf import reshard as run
    with err.status(f'resharding {text(path)} to tp {tp} x pp {pp} ...'):
        done = run(path, out_dir, tp, pp, balance)
    shown = text(done)
    out.print(f'[bold green]resharded[/] {text(path)} into {shown} for tp {tp} x pp {pp}; continue training with '
              f'[bold]gptkit train --out {shown} --config {shown}/config.json --resume --tp {tp} --pp {pp} '
              '--data PREFIX[/] '
              '(the optimizer restarts at the saved step)', soft_wrap=True)
