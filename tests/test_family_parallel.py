"""Issue 31's model choices (QK norm with its own head size, a QKV bias alone, a sliding window, YaRN) under TP, TP + SP
and PP on real gloo process groups: losses and gradients equal the single-process model's; checkpoints reshard back."""
import copy
import dataclasses

import torch
import torch.distributed as dist
from conftest import run_here
from test_parallel_model import grads_then_sgd, spawn

from gptkit.checkpoint import checkpointing as ck

from gptkit.store import folders as store
from gptkit.config.sections import LLAMA, ModelConfig
from gptkit.estimate.sizing import count_params
from gptkit.interop.hf import write_run
from gptkit.model.decoder import GPT
from gptkit.parallel.groups import (Layout, ParallelState, apply_tp, merge_weights, one_f_one_b, pipeline_stage, stage_input_shape)
from gptkit.tokenizer.bpe import load_tokenizer

BASE = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=200, tie_embeddings=False, **LLAMA)
FAMILIES = {   # Qwen3's choices with one KV head (a copy on each of 2 ranks), Qwen2's bias, Mistral's window, YaRN
    'qk_norm': dataclasses.replace(BASE, qk_norm=True, head_size=12, kv_heads=1),
    'qkv_bias': dataclasses.replace(BASE, qkv_bias=True),
    'sliding_window': dataclasses.replace(BASE, sliding_window=5),
    'yarn': dataclasses.replace(BASE, rope_scaling='yarn', rope_factor=4.0, rope_original_context=8),
}


def _errors(cfg, ps, sp, micro):
    "Largest loss, gradient and trained-weight differences between `cfg` on layout `ps` and one process, over 2 steps"
    torch.manual_seed(0)
    plain = GPT(cfg)
    ref = copy.deepcopy(plain)
    model = pipeline_stage(apply_tp(plain, ps, sequence_parallel=sp), ps)
    held = sum(p.numel() for p in model.parameters())          # the estimator's count for this rank
    assert held == count_params(cfg, ps.layout.tp, ps.layout.pp).stages[ps.pp_rank].per_rank
    data = torch.randint(0, cfg.vocab, (2, 4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    errs = {'loss': 0.0, 'grad': 0.0}
    for batch in data:
        losses = one_f_one_b(model, lambda loss, last: (loss / micro if last else loss).backward(),
                             [(x[:, :-1], x[:, 1:]) for x in batch.chunk(micro)], parallel=ps,
                             shape=stage_input_shape(cfg, len(batch) // micro, ps.layout.tp, sp), dtype=torch.float32,
                             device='cpu')
        want = ref(batch[:, :-1], batch[:, 1:])
        want.backward()
        if ps.is_last_stage:
            errs['loss'] = max(errs['loss'], abs(torch.stack(losses).mean().item() - want.item()))
        grads_then_sgd(model, ref, cfg, ps, errs)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, ((ps.tp_rank, ps.pp_rank), {n: t.detach() for n, t in model.state_dict().items()}))
    merged = merge_weights(dict(shards), cfg, ps.layout.tp)
    errs['weights'] = max((merged[n] - t).abs().max().item() for n, t in ref.state_dict().items())
    return errs


def _worker(rank, world, init_file, out):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        tp, pp = ParallelState.build(Layout(tp=2)), ParallelState.build(Layout(pp=2))
        errs = {(name, sp): _errors(cfg, tp, sp, 2) for name, cfg in FAMILIES.items() for sp in (False, True)}
        errs['qk_norm', 'pp'] = _errors(FAMILIES['qk_norm'], pp, False, 2)
        torch.save(errs, f'{out}/{rank}.pt')
    finally:
        dist.destroy_process_group()


def test_model_choices_under_tp_sp_and_pp_equal_the_single_process_model(tmp_path):
    spawn(_worker, 2, str(tmp_path / 'init'), str(tmp_path))
    for rank in range(2):
        errs = torch.load(tmp_path / f'{rank}.pt')
        assert len(errs) == 9
        for key, e in errs.items():
            assert e['loss'] < 1e-5 and e['grad'] < 1e-5 and e['weights'] < 1e-5, (rank, key, e)


EVERY = dataclasses.replace(BASE, qk_norm=True, head_size=12, qkv_bias=True, sliding_window=5, rope_scaling='yarn',
                            rope_factor=4.0, rope_original_context=8)


def test_a_checkpoint_of_the_new_choices_reshards_to_tp2_and_back_unchanged(tiny_data, tmp_path):
    "`gptkit checkpoint reshard` tp 1 -> tp 2 x pp 2 -> tp 1: every tensor and the model config as they were"
    tok = load_tokenizer(tiny_data[1])
    cfg = dataclasses.replace(EVERY, vocab=tok.vocab_size)
    torch.manual_seed(0)
    run = write_run(GPT(cfg).state_dict(), cfg, tok, tmp_path / 'run', 'a random model of every choice')
    for src, dst, tp, pp in ((run, 'split', 2, 2), (tmp_path / 'split', 'back', 1, 1)):
        r = run_here('checkpoint', 'reshard', src, tmp_path / dst, '--tp', tp, '--pp', pp)
        assert r.returncode == 0, r.stdout + r.stderr
    split = torch.load(store.find(tmp_path / 'split') / 'mp_rank_01_model_states.pt', weights_only=True)['module']
    assert split['blocks.0.attn.q_norm.weight'].shape == (12,) and split['blocks.0.attn.qkv.bias'].shape == (48,)
    a, b = ck.load_weights(run), ck.load_weights(tmp_path / 'back')
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert ck.read_config(store.find(tmp_path / 'back')).model == cfg
