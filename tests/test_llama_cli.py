"""The Llama family through the tools: training with DeepSpeed, generation with a rotary grouped-query KV cache,
serving, evaluation, profiling and `gptkit estimate --preset llama-...`."""
import json

import httpx
import pytest
import torch

from conftest import run_here
from gptkit.inference.batching import Limits
from gptkit.inference.generator import Generator, reference_greedy
from gptkit.inference.sampling import Sampling
from gptkit.serve.server import Server

LLAMA_SETS = ['model.layers=2', 'model.hidden=32', 'model.heads=4', 'model.kv_heads=2', 'model.seq_len=32',
              'train.micro_batch=2', 'train.global_batch=4', 'train.precision=fp32', 'train.iters=4',
              'train.eval_interval=2', 'train.eval_iters=1', 'train.log_interval=1', 'optim.lr=3e-3', 'optim.warmup=1']


@pytest.fixture(scope='module')
def llama_checkpoint(tiny_data, tmp_path_factory):
    "A random Llama-style run (rotary, RMSNorm, SwiGLU, 2 KV heads for 4 query heads, untied), context 64"
    from gptkit.config.sections import LLAMA, ModelConfig
    from gptkit.interop.hf import write_run
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import load_tokenizer
    tok = load_tokenizer(tiny_data[1])
    torch.manual_seed(0)
    cfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=64, vocab=tok.vocab_size,
                      tie_embeddings=False, **LLAMA)
    return write_run(GPT(cfg).state_dict(), cfg, tok, tmp_path_factory.mktemp('llama') / 'run', 'a random Llama')


@pytest.fixture(scope='module')
def gen(llama_checkpoint):
    return Generator.from_checkpoint(llama_checkpoint, device='cpu')


def test_generation_with_a_rotary_grouped_query_cache_matches_the_plain_loop(gen):
    "A batch of prompts of different lengths (left-padded), decoded with the cache, gives the full-forward greedy tokens"
    prompts = ['In the beginning God', 'And', 'Thus saith the LORD of hosts, the God of Israel']
    got = gen.complete(prompts, Sampling(max_new_tokens=20, greedy=True, stop_at_eod=False))
    for p, c in zip(prompts, got):
        assert c.tokens == reference_greedy(gen.model, gen.tok.encode(p), 20)


def test_serving_a_llama(gen):
    with Server(gen, Limits(max_new_tokens=16, max_prompts=4, max_waiting=8), name='llama') as url:
        r = httpx.post(url + '/v1/completions', json={'prompt': 'And God said', 'max_tokens': 8, 'temperature': 0})
    want = gen.complete(['And God said'], Sampling(max_new_tokens=8, greedy=True))[0]
    assert r.status_code == 200 and r.json()['choices'][0]['text'] == want.text


def test_train_eval_profile_and_estimate_a_llama(tiny_data, tmp_path):
    prefix, tok = tiny_data
    sets = [a for s in LLAMA_SETS for a in ('--set', s)]
    r = run_here('train', '--preset', 'llama-tiny', '--data', prefix, '--tokenizer', tok, '--out', tmp_path / 'run', *sets)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    losses = [s['loss'] for s in steps if s['kind'] == 'train']
    assert len(losses) == 4 and losses[-1] < losses[0]
    model = json.loads((tmp_path / 'run' / 'config.json').read_text())['model']
    assert (model['position'], model['norm'], model['activation'], model['kv_heads']) == ('rotary', 'rmsnorm', 'swiglu', 2)
    r = run_here('eval', '--checkpoint', tmp_path / 'run', '--max-documents', '4')
    assert r.returncode == 0 and 'perplexity' in r.stdout, r.stdout + r.stderr
    r = run_here('profile', '--preset', 'llama-tiny', '--data', prefix, '--tokenizer', tok, '--steps', '1',
                 '--out', tmp_path / 'prof', *sets)
    assert r.returncode == 0 and (tmp_path / 'prof' / 'summary.json').is_file(), r.stdout + r.stderr
    r = run_here('estimate', '--preset', 'Llama-3.2-1B', '--json')
    assert r.returncode == 0, r.stdout + r.stderr
    est = json.loads(r.stdout)
    assert est['params']['total'] == 1_235_814_400


def test_quickstart_takes_either_cpu_sized_family(tmp_path):
    r = run_here('quickstart', '--out', tmp_path / 'qs', '--preset', '125m')
    assert r.returncode == 2 and "--preset must be one of tiny, llama-tiny, moe-tiny (CPU-sized), not '125m'" in r.stderr
    assert not (tmp_path / 'qs').exists()                 # refused before anything is written
