"""Generation, continuous batching, serving and evaluation with issue 31's model choices: Qwen3's per-head QK norms with
heads wider than hidden / heads, Mistral's sliding window (decoding well past it, rows left-padded and joining later)
and YaRN's rescaled rotary give the plain loop's greedy tokens; `gptkit eval` gives transformers' loss."""
import json
import threading

import pytest
import torch
from conftest import run_here, torch_threads

from gptkit.inference.batching import Limits, RunningBatch
from gptkit.config.sections import LLAMA, ModelConfig
from gptkit.inference.generator import Generator, reference_greedy
from gptkit.inference.sampling import Sampling

BASE = dict(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=64, tie_embeddings=False, init_std=0.1, **LLAMA)
CHOICES = {'qwen3': dict(qk_norm=True, head_size=16),          # 4 heads of 16 over a width of 32
           'mistral': dict(sliding_window=6),                  # shorter than every prompt and answer below
           'yarn': dict(rope_scaling='yarn', rope_factor=4.0, rope_original_context=16)}
PROMPTS = ['In the beginning God created the heaven and the earth', 'And', 'Thus saith the LORD']
GREEDY = Sampling(max_new_tokens=20, greedy=True, stop_at_eod=False)


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    with torch_threads(1): yield


@pytest.fixture(scope='module')
def runs(tiny_data, tmp_path_factory):
    "A gptkit run folder of a random tiny model with each choice (norm weights not ones, so a misplaced norm shows)"
    from gptkit.interop.hf import write_run
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import load_tokenizer
    tok = load_tokenizer(tiny_data[1])
    out = {}
    for name, choice in CHOICES.items():
        torch.manual_seed(0)
        cfg = ModelConfig(vocab=tok.vocab_size, **BASE, **choice)
        model = GPT(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.3 * torch.randn_like(p))
        out[name] = write_run(model.state_dict(), cfg, tok, tmp_path_factory.mktemp(name) / 'run', f'a random {name}')
    return out


@pytest.fixture(scope='module')
def gens(runs):
    return {name: Generator.from_checkpoint(run, device='cpu') for name, run in runs.items()}


@pytest.mark.parametrize('name', list(CHOICES))
def test_a_left_padded_batch_decodes_the_plain_loops_tokens(gens, name):
    gen = gens[name]
    got = gen.complete(PROMPTS, GREEDY)
    for p, c in zip(PROMPTS, got):
        assert c.tokens == reference_greedy(gen.model, gen.tok.encode(p), 20), (name, p)
    assert len({tuple(c.tokens) for c in got}) == 3                      # not a degenerate model


@pytest.mark.parametrize('name', ['mistral', 'qwen3'])
def test_rows_joining_a_running_batch_later_give_their_tokens_alone(gens, name):
    gen = gens[name]
    batch, got = RunningBatch(gen), {}
    enc = [gen.tok.encode(p) for p in PROMPTS]
    for k in batch.join(enc[:1], GREEDY):
        got[k] = []
    for step in range(20):
        if step == 7:                                                     # two rows of different lengths join
            got.update({k: [] for k in batch.join(enc[1:], GREEDY)})
        for c in batch.sample():
            got[c.index].append(c.token)
    while batch:
        for c in batch.sample():
            got[c.index].append(c.token)
    assert [got[k] for k in sorted(got)] == [gen.complete([p], GREEDY)[0].tokens for p in PROMPTS]


def test_the_window_changes_the_tokens(gens, runs):
    "The control: the same weights without the window decode other tokens, so the tests above see the window at work"
    import dataclasses

    from gptkit.checkpoint.checkpointing import load_model
    from gptkit.model.decoder import GPT
    loaded = load_model(runs['mistral'])
    plain = GPT(dataclasses.replace(loaded.config.model, sliding_window=None))
    plain.load_state_dict(loaded.model.state_dict())
    other = Generator(plain, loaded.tokenizer).complete(PROMPTS, GREEDY)
    assert [c.tokens for c in other] != [c.tokens for c in gens['mistral'].complete(PROMPTS, GREEDY)]


def test_kv_cache_bytes_are_what_the_cache_allocates(gens):
    from gptkit.model.decoder import KVCache
    for gen in gens.values():
        cache = KVCache.for_model(gen.model, 3, gen.context)
        assert gen.kv_cache_bytes(3) == sum(t.nbytes for t in [*cache.k.values(), *cache.v.values()])
    cfg = gens['qwen3'].model.cfg
    assert gens['qwen3'].kv_cache_bytes(1) == 2 * cfg.layers * cfg.seq_len * cfg.kv * 16 * 4    # heads of 16, fp32


def test_cli_generate_prints_the_greedy_text(runs, gens):
    r = run_here('generate', '--checkpoint', runs['mistral'], '--prompt', PROMPTS[0], '--greedy', '--max-new-tokens', 20)
    assert r.returncode == 0, r.stderr
    want = gens['mistral'].complete(PROMPTS[:1], Sampling(max_new_tokens=20, greedy=True))[0]
    assert PROMPTS[0] + want.text in r.stdout


def test_the_server_answers_as_the_generator(gens):
    import httpx

    from gptkit.serve.server import Server
    gen = gens['mistral']
    answers = {}
    with Server(gen, Limits(max_new_tokens=32, max_prompts=8), name='mistral') as url:
        def ask(key, prompt):
            body = {'prompt': prompt, 'max_tokens': 20, 'temperature': 0}
            answers[key] = httpx.post(url + '/v1/completions', json=body, timeout=60).json()
        threads = [threading.Thread(target=ask, args=('all', PROMPTS)),            # one request, three rows
                   threading.Thread(target=ask, args=('one', PROMPTS[1]))]         # and another, batched with it
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    want = gen.complete(PROMPTS, Sampling(max_new_tokens=20, greedy=True))
    assert [c['text'] for c in answers['all']['choices']] == [w.text for w in want]
    assert answers['one']['choices'][0]['text'] == want[1].text


def test_cli_eval_gives_transformers_loss(tiny_data, tmp_path):
    "Mistral as transformers builds it (window 6), imported, evaluated in overlapping windows of its 64-token context"
    import torch.nn.functional as F
    from test_families import make_family

    import gptkit.eval.perplexity as ev
    from gptkit.interop.hf import import_hf
    hf = make_family('mistral', tiny_data[1], tmp_path / 'hf')
    run = import_hf(tmp_path / 'hf', tmp_path / 'run')
    text = ' '.join(['And God said, Let there be light: and there was light.'] * 12)
    (tmp_path / 'a.txt').write_text(text)
    r = run_here('eval', '--checkpoint', run, '--text', tmp_path / 'a.txt', '--stride', 24, '--batch-size', 3, '--json')
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)['perplexity']
    from gptkit.tokenizer.bpe import load_tokenizer
    tok = load_tokenizer(tiny_data[1])
    ids = tok.encode(text) + [tok.eod]
    assert got['tokens'] == len(ids) > 2 * 64 and got['windows'] > 3
    total, count = 0.0, 0
    with torch.no_grad():
        for w in ev.windows(len(ids), 64, 24):
            x, y = torch.tensor([ids[w.start:w.stop]]), torch.tensor(ids[w.start + 1:w.stop + 1])
            loss = F.cross_entropy(hf(x).logits[0].double(), y, reduction='none')[w.first:]
            total, count = total + loss.sum().item(), count + len(loss)
    assert count == got['scored'] and got['loss'] == pytest.approx(total / count, rel=1e-5)
