"""Sharded Hugging Face folders (model.safetensors.index.json and its shards) against transformers' own: import of
what save_pretrained(max_shard_size=...) writes, export that from_pretrained loads, and hostile folders refused."""
import json
import logging
import os
import shutil

import pytest
import torch

os.environ['HF_HUB_OFFLINE'] = '1'          # nothing here may reach the network

from conftest import run_here, train_tokenizer
from test_llama_interop import make_llama

from gptkit.checkpoint import checkpointing as ck

from gptkit.interop import hf_files

from gptkit.interop import hf as interop
from gptkit.interop.hf_files import INDEX, SINGLE
from gptkit.store.folders import CheckpointError
from gptkit.tokenizer.bpe import EOD

SHARD = '40KB'                              # the tiny models below are ~200 kB: 4 to 6 shards


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory):
    return train_tokenizer('kjv', 512, tmp_path_factory.mktemp('tok') / 'tok')


def shards_of(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith('model-'))


def ids_for(vocab: int):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def logits_diff(run, hf) -> float:
    ids = ids_for(hf.config.vocab_size)
    with torch.no_grad():
        return (ck.load_model(run).model(ids) - hf(ids).logits).abs().max().item()


def with_tokenizer(src, dst):
    for f in ('tokenizer.json', 'tokenizer_config.json'):
        shutil.copy(src / f, dst / f)


@pytest.fixture(scope='module')
def llama(tok_dir, tmp_path_factory):
    "(HF Llama, the folder transformers sharded it into, the gptkit run imported from it)"
    d = tmp_path_factory.mktemp('llama')
    model = make_llama(str(tok_dir), d / 'one', tie=False)
    model.save_pretrained(d / 'sharded', max_shard_size=SHARD)
    with_tokenizer(d / 'one', d / 'sharded')
    return model, d / 'sharded', interop.import_hf(d / 'sharded', d / 'run')


def test_llama_sharded_by_transformers_imports_with_its_logits(llama):
    hf, folder, run = llama
    assert len(shards_of(folder)) >= 3 and not (folder / SINGLE).exists()
    assert logits_diff(run, hf) <= 1e-4


def test_gpt2_sharded_by_transformers_imports_with_its_logits(tok_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                    bos_token_id=0, eos_token_id=0)).eval()
    hf.save_pretrained(tmp_path / 'hf', max_shard_size=SHARD)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / 'tokenizer.json'), eos_token=EOD)
    tok.save_pretrained(tmp_path / 'hf')
    assert len(shards_of(tmp_path / 'hf')) >= 3
    assert logits_diff(interop.import_hf(tmp_path / 'hf', tmp_path / 'run'), hf) <= 1e-4


def test_export_shards_above_the_size_and_transformers_loads_them(llama, tmp_path):
    from transformers import LlamaForCausalLM
    hf, _, run = llama
    one = interop.export_hf(run, tmp_path / 'one')                       # 200 kB, far below the 5 GB default
    assert (one / SINGLE).is_file() and not (one / INDEX).exists() and not shards_of(one)
    out = interop.export_hf(run, tmp_path / 'sharded', max_shard_size=SHARD)
    names = shards_of(out)
    assert len(names) >= 3 and not (out / SINGLE).exists()
    weight_map = json.loads((out / INDEX).read_text())['weight_map']
    assert sorted(set(weight_map.values())) == names
    for f in names:                         # under the size (and its header), or one tensor bigger than it alone
        assert os.path.getsize(out / f) <= 40_000 + 1024 or list(weight_map.values()).count(f) == 1, f
    back = LlamaForCausalLM.from_pretrained(out).eval()
    ids = ids_for(hf.config.vocab_size)
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() <= 1e-4


def test_the_cut_is_huggingface_hubs(llama):
    "The tensors of each file are those huggingface_hub's own splitter puts together"
    from huggingface_hub import split_torch_state_dict_into_shards
    sd = llama[0].state_dict()
    for most in (10_000, 40_000, 100_000, 10**9):
        want = split_torch_state_dict_into_shards(sd, max_shard_size=most).filename_to_tensors.values()
        got = hf_files.shard_groups({k: t.nbytes for k, t in sd.items()}, most)
        assert sorted(map(sorted, got)) == sorted(map(sorted, want)), most


def test_cli_export_max_shard_size(llama, tmp_path):
    run = llama[2]
    r = run_here('checkpoint', 'export', run, tmp_path / 'hf', '--to', 'hf', '--max-shard-size', '40kB')
    assert r.returncode == 0, r.stderr
    assert len(shards_of(tmp_path / 'hf')) >= 3 and (tmp_path / 'hf' / INDEX).is_file()
    for flags, said in ((['--to', 'hf', '--max-shard-size', '5 parsecs'], '--max-shard-size must be a size such as'),
                        (['--to', 'megatron', '--max-shard-size', '1GB'], 'only used with --to hf')):
        r = run_here('checkpoint', 'export', run, tmp_path / 'bad', *flags)
        assert r.returncode == 2 and said in r.stderr and 'Traceback' not in r.stderr, r.stderr   # a usage error
        assert not (tmp_path / 'bad').exists()


def test_hugging_face_cache_links_into_its_blobs_are_read(llama, tmp_path):
    "The Hub cache keeps snapshots/REV/NAME as links to ../../blobs/HASH: the one place outside a folder read"
    hf, folder, _ = llama
    snap = tmp_path / 'models--x--y' / 'snapshots' / 'abc123'
    (tmp_path / 'models--x--y' / 'blobs').mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(folder))):
        shutil.copy(folder / f, tmp_path / 'models--x--y' / 'blobs' / f'blob{i}')
        (snap / f).symlink_to(f'../../blobs/blob{i}')
    assert logits_diff(interop.import_hf(snap, tmp_path / 'run'), hf) <= 1e-4


def test_both_files_read_the_single_one_as_transformers_does(llama, tmp_path, caplog):
    hf, folder, run = llama
    d = interop.export_hf(run, tmp_path / 'hf')
    shutil.copy(folder / INDEX, d / INDEX)                     # an index whose shards are not there
    with caplog.at_level(logging.WARNING, logger='gptkit.interop.hf_files'):
        back = interop.import_hf(d, tmp_path / 'run')
    assert f'holds both {SINGLE} and {INDEX}; reading {SINGLE}' in caplog.text
    assert logits_diff(back, hf) <= 1e-4


def index_of(f):
    return json.loads((f / INDEX).read_text())


def point(key, to):
    "The index maps `key` to `to`"
    def change(f):
        index = index_of(f)
        index['weight_map'][key] = to
        (f / INDEX).write_text(json.dumps(index))
    return change


def holds_also(key):
    "The last shard holds its own tensors and `key` too"
    def change(f):
        from safetensors.torch import load_file, save_file
        last = f / shards_of(f)[-1]
        save_file({**load_file(last), key: torch.zeros(1)}, last)
    return change


def shard(i: int, data: bytes):
    return lambda f: (f / shards_of(f)[i]).write_bytes(data)


def folder_instead(i: int):
    "Shard `i` replaced by a folder of its name"
    def change(f):
        p = f / shards_of(f)[i]
        p.unlink()
        p.mkdir()
    return change


def bin_shards(f):
    "Weights as sharded pytorch_model-*.bin files"
    for n in shards_of(f) + [INDEX]:
        (f / n).unlink()
    (f / 'pytorch_model.bin.index.json').write_text('{}')


def relink(i: int, to):
    "Shard `i` replaced by a link to `to` (relative to the folder's parent)"
    def change(f):
        p = f / shards_of(f)[i]
        p.unlink()
        p.symlink_to(f.parent / to)
    return change


EMBED = 'model.embed_tokens.weight'
HOSTILE = {
    'parent': (point(EMBED, '../secret.safetensors'),
               f"weight_map['{EMBED}'] is '../secret.safetensors', not the name of a .safetensors file beside it"),
    'absolute': (lambda f: point(EMBED, str(f.parent / 'secret.safetensors'))(f), f"weight_map['{EMBED}'] is '/"),
    'nul': (point(EMBED, 'a\x00.safetensors'), f"weight_map['{EMBED}'] is 'a\\x00.safetensors', not the name"),
    'not a string': (point(EMBED, 3), f"weight_map['{EMBED}'] is 3, not the name of a .safetensors file"),
    'another kind of file': (point(EMBED, 'config.json'), f"weight_map['{EMBED}'] is 'config.json', not the name"),
    'link out': (relink(0, 'secret.safetensors'), 'which links to'),
    'link to a device': (relink(0, '/dev/zero'), 'links to /dev/zero, outside'),
    'dangling link': (relink(0, 'nothing.safetensors'), 'which links to'),
    'shard missing': (lambda f: (f / shards_of(f)[0]).unlink(), '{first}, which is not in'),
    'shard a folder': (folder_instead(0), 'which is not a regular file in'),
    'tensor absent': (lambda f: point(EMBED, shards_of(f)[-1])(f), f'maps {EMBED} to {{last}}, '
                                                                   'which does not hold it'),
    'held elsewhere too': (holds_also(EMBED), f'{{last}} holds {EMBED}, but {INDEX} maps it to {{first}}'),
    'held unlisted': (holds_also('extra.weight'), f'holds extra.weight, but {INDEX} does not list it'),
    'index not json': (lambda f: (f / INDEX).write_text('{"weight_map": '), 'is not valid JSON'),
    'index a list': (lambda f: (f / INDEX).write_text('[]'), 'holds an array, not an object'),
    'index huge': (lambda f: os.truncate(f / INDEX, 2**30), 'more than the 16.0 MiB read'),
    'no weight_map': (lambda f: (f / INDEX).write_text('{"metadata": {}}'), 'weight_map must map each tensor'),
    'empty weight_map': (lambda f: (f / INDEX).write_text('{"weight_map": {}}'), 'weight_map must map each tensor'),
    'truncated header': (shard(1, b'\x10\x00\x00'), '{second} is not a safetensors file'),
    'huge header': (shard(1, (2**40).to_bytes(8, 'little') + b'{}'), 'header too large'),
    'header not json': (shard(1, (2).to_bytes(8, 'little') + b'{x'), '{second} is not a safetensors file'),
    'sharded bin': (bin_shards, 'sharded pytorch_model-*.bin files'),
}


@pytest.mark.parametrize('case', HOSTILE)
def test_a_hostile_folder_is_refused_naming_file_and_key(case, llama, tmp_path):
    folder = tmp_path / 'hf'
    shutil.copytree(llama[1], folder)
    (tmp_path / 'secret.safetensors').write_bytes((folder / shards_of(folder)[0]).read_bytes())
    names = shards_of(folder)
    change, said = HOSTILE[case]
    said = said.format(first=names[0], second=names[1], last=names[-1])
    change(folder)
    with pytest.raises(CheckpointError) as e:
        interop.import_hf(folder, tmp_path / 'run')
    assert said in str(e.value) and '\n' not in str(e.value), str(e.value)
    assert str(folder) in str(e.value)
    assert not (tmp_path / 'run').exists() and not [p for p in os.listdir(tmp_path) if '.tmp' in p]


def test_a_hostile_folder_is_one_line_on_the_command_line(llama, tmp_path):
    folder = tmp_path / 'hf'
    shutil.copytree(llama[1], folder)
    point(EMBED, '../../etc/passwd.safetensors')(folder)
    r = run_here('checkpoint', 'import', folder, tmp_path / 'run', '--from', 'hf')
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr
    assert f"weight_map['{EMBED}'] is '../../etc/passwd.safetensors'" in r.stderr
    assert not (tmp_path / 'run').exists()
