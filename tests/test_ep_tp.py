"""Mixture-of-experts layers under tensor parallelism (issue 32, items 2 and 6): the MoE runs whole on every TP rank
(with sequence parallelism on the gathered sequence), so on gloo processes the losses, the load-balancing and z-losses'
gradients and the trained weights equal one process's; an MoE checkpoint generates and evaluates under TP 2 as on
one process; expert parallelism composes with TP (EP 2 x TP 2) in gptkit's engine and training step."""
import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from test_parallel_model import grads_then_sgd, spawn

from gptkit.checkpoint import checkpointing as ckpt
from gptkit.parallel import groups as parallel
from gptkit.checkpoint.checkpointing import load_model
from gptkit.config.sections import LLAMA, ModelConfig
from gptkit.train.engine import build_engine, free_port, init_distributed
from gptkit.eval.perplexity import evaluate
from gptkit.parallel.expert import AllToAll, ep_layers
from gptkit.inference.generator import Generator
from gptkit.interop.hf import write_run
from gptkit.model.decoder import GPT
from gptkit.model.moe import moe_stats
from gptkit.parallel.groups import (
    DeepSpeedMPU,
    Layout,
    ParallelState,
    apply_tp,
    merge_weights,
    one_f_one_b,
    parallelize,
    pipeline_stage,
    stage_input_shape,
)
from gptkit.config.run import resolve
from gptkit.inference.sampling import Sampling
from gptkit.parallel.tensor import WholeSequenceMLPBlock
from gptkit.tokenizer.bpe import load_tokenizer
from gptkit.train.loop import _step

LOSSES = dict(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
BASE = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=64, tie_embeddings=False,
                   moe_experts=4, moe_top_k=2, moe_ffn_hidden=24, **LOSSES, **LLAMA)
MODELS = {   # SwiGLU top 2 on every layer; a dense layer then an MoE with a shared expert; GELU top 1 with a capacity
    # (a vocabulary of 64 padded to 256 under TP 2: rank 1's block of the output layer is padding only)
    'every': BASE,
    'mixed_shared': dataclasses.replace(BASE, moe_every=2, moe_shared_ffn=16),
    'gelu_capacity': ModelConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=200, dropout=0.0, moe_experts=4,
                                 moe_top_k=1, moe_capacity_factor=1.0, **LOSSES),
}


def _model_errors(cfg, ps, sp: bool, micro: int = 2, recompute: str = 'none') -> dict:
    """Largest loss, MoE-statistics, gradient and trained-weight differences between `cfg` on layout `ps` (TP, SP) and
    one process over 2 SGD steps of `micro` accumulated micro-batches (each one forward on both: the MoE losses are
    per forward)"""
    torch.manual_seed(0)
    plain = GPT(cfg)
    ref = copy.deepcopy(plain)
    model = pipeline_stage(apply_tp(plain, ps, sequence_parallel=sp), ps).set_recompute(recompute)
    data = torch.randint(0, cfg.vocab, (2, 4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    errs = {'loss': 0.0, 'stats': 0.0, 'grad': 0.0}
    for batch in data:
        chunks = [(x[:, :-1], x[:, 1:]) for x in batch.chunk(micro)]
        def backward(loss, last):
            (loss / micro if last else loss).backward()
        losses = one_f_one_b(model, backward, chunks, parallel=ps,
                             shape=stage_input_shape(cfg, len(batch) // micro, ps.layout.tp, sp), dtype=torch.float32,
                             device='cpu')
        got_stats = moe_stats(model)                             # the last micro-batch's
        want = []
        for x, y in chunks:
            want.append(ref(x, y))
            (want[-1] / micro).backward()
        want_stats = moe_stats(ref)
        errs['stats'] = max([errs['stats']] + [abs(got_stats[k] - v) for k, v in want_stats.items()])
        errs['loss'] = max(errs['loss'], abs(torch.stack(losses).mean().item() - torch.stack(want).mean().item()))
        grads_then_sgd(model, ref, cfg, ps, errs)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, ((ps.tp_rank, ps.pp_rank), {n: t.detach() for n, t in model.state_dict().items()}))
    merged = merge_weights(dict(shards[:ps.layout.tp]), cfg, ps.layout.tp)
    errs['weights'] = max((merged[n] - t).abs().max().item() for n, t in ref.state_dict().items())
    errs['whole_blocks'] = sum(type(b) is WholeSequenceMLPBlock for b in model.blocks.values())
    return errs


PROMPTS = ['In the beginning God created', 'And']
HELD_OUT = ('In the beginning God created the heaven and the earth. And the earth was without form, and void; and '
            'darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.\n')


def _outputs(gen: Generator) -> dict:
    "Logits of two prompts' first tokens and 8 greedy tokens each"
    rows = [gen.tok.encode(p) for p in PROMPTS]
    with torch.inference_mode():
        logits = gen.logits(torch.tensor([rows[0][:5], rows[0][1:6]]))
    greedy = Sampling(max_new_tokens=8, greedy=True, stop_at_eod=False)
    tokens = [[c.token for c in gen.stream(PROMPTS, greedy) if c.index == i and c.token is not None]
              for i in range(len(PROMPTS))]
    return {'logits': logits.tolist(), 'greedy': tokens}


def _tp_worker(rank, world, init_file, out, ckpts, text):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        tp = ParallelState.build(Layout(tp=2))
        errs = {(name, sp): _model_errors(cfg, tp, sp) for name, cfg in MODELS.items() for sp in (False, True)}
        errs['mixed_shared', 'full recompute'] = _model_errors(MODELS['mixed_shared'], tp, True, recompute='full')
        whole, parallel.whole_sequence_mlp = parallel.whole_sequence_mlp, lambda block, group: block
        try:                                     # the control: under SP each rank's MoE on its own slice only
            errs['control'] = _model_errors(MODELS['every'], tp, True)
        finally:
            parallel.whole_sequence_mlp = whole
        got = {}
        for c in ckpts:
            got[c] = _outputs(Generator.from_checkpoint(c, device='cpu', tp=world))     # generate/serve --tp 2
            got[c]['eval'] = evaluate(c, text, tp=world).perplexity.loss                 # gptkit eval --tp 2
        torch.save({'errors': errs, 'generated': got}, f'{out}/{rank}.pt')
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope='module')
def moe_checkpoint(tiny_data, tmp_path_factory):
    "A random tiny MoE run folder (a dense layer, then an MoE with a shared expert)"
    tok = load_tokenizer(tiny_data[1])
    torch.manual_seed(0)
    cfg = dataclasses.replace(MODELS['mixed_shared'], vocab=tok.vocab_size, seq_len=64)
    return write_run(GPT(cfg).state_dict(), cfg, tok, tmp_path_factory.mktemp('moe') / 'run', 'a random tiny MoE')


class _NoReturn(AllToAll):
    "The control: rows go to the experts' ranks, but no gradient comes back to the rank that sent them"
    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(sum(ctx.send), *grad.shape[1:]), None, None, None


TRAIN_SETS = ['model.layers=2', 'model.hidden=32', 'model.heads=4', 'model.kv_heads=2', 'model.seq_len=16',
              'model.vocab=512', 'model.moe_experts=4', 'model.moe_ffn_hidden=24', 'model.moe_z_loss_coef=0.001',
              'train.micro_batch=1', 'train.global_batch=4', 'train.iters=3', 'train.precision=fp32',
              'optim.lr=1e-2', 'optim.warmup=1', 'optim.grad_clip=0.05']


def _run(tp: int, ep: int, sp: bool, control: bool = False, save: tuple | None = None) -> dict:
    """Three clipped steps of moe-tiny shrunk (TRAIN_SETS) through gptkit's engine and step: losses, norms, whole
    weights; `save` (folder, tokenizer): a checkpoint of the run there, as gptkit train writes it"""
    cfg = resolve('moe-tiny', sets=TRAIN_SETS + [f'parallel.ep={ep}', f'parallel.tp={tp}',
                                                 f'parallel.sequence_parallel={str(sp).lower()}'])
    world = dist.get_world_size()
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=world // tp))
    torch.manual_seed(0)
    parallel = ParallelState.build(cfg.layout)
    plain = GPT(cfg.model)
    shapes = ckpt.model_shapes(plain)
    model = parallelize(plain, parallel, 'none', cfg.train.seed)
    engine, ds = build_engine(cfg, model, mpu=DeepSpeedMPU(parallel) if tp > 1 else None)
    for _, layer in ep_layers(engine.module):
        layer.exchange = _NoReturn if control else AllToAll
    data = torch.randint(0, 64, (3, 4, 17), generator=torch.Generator().manual_seed(1))   # 3 steps of 4 sequences
    losses, norms = [], []
    for batch in data:
        mine = batch.chunk(parallel.layout.dp)[parallel.dp_rank]   # this replica's micro-batches, accumulated
        loss, _, norm = _step(engine, parallel, [(s[None, :-1], s[None, 1:]) for s in mine], True,
                              cfg.optim.grad_clip)
        t = torch.tensor(loss)
        dist.all_reduce(t)                                         # the first TP ranks' sums
        losses.append(t.item() / 4)
        norms.append(norm)
    if save:
        ckpt.save(engine, save[0], 3, client={'iteration': 3, 'consumed_samples': 12}, cfg=cfg, ds_config=ds,
                  tokenizer_dir=save[1], rank=dist.get_rank(), layout=parallel.layout, shapes=shapes)
    weights = {}
    for name, p in engine.module.named_parameters():
        w = p.detach()
        if getattr(p, 'ep_group', None) is not None:             # every rank's experts
            parts = [torch.empty_like(w) for _ in range(dist.get_world_size(p.ep_group))]
            dist.all_gather(parts, w.contiguous(), group=p.ep_group)
            w = torch.cat(parts)
        weights[name] = w.clone()
    shards = [None] * world
    dist.all_gather_object(shards, (parallel.tp_rank, parallel.dp_rank, weights))
    whole = merge_weights({(t, 0): w for t, d, w in shards if d == 0}, cfg.model, tp)
    return {'losses': losses, 'norms': norms, 'weights': whole}


def _train_worker(rank, world, init_file, out, port, slow, tokenizer):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed()
    try:
        runs = {'one': _run(1, 1, False)} if world == 1 else {
            'ep2 x tp2': _run(2, 2, False, save=(f'{out}/ep_run/checkpoints', tokenizer)),
            'control': _run(2, 2, False, True)}
        if world > 1 and slow:
            runs['ep2 x tp2 sp'] = _run(2, 2, True)
        if rank == 0:
            torch.save(runs, f'{out}/train{world}.pt')
        dist.barrier()                                             # no rank leaves while its peers still talk to it
    finally:
        dist.destroy_process_group()


def test_moe_under_tp_and_ep2_x_tp2_equal_one_process(moe_checkpoint, tiny_data, tmp_path, request):
    """EP 2 x TP 2 (4 gloo processes, ZeRO 0, fp32, every step clipped) and, with --nb-flags slow, with SP as well: the
    one-process losses, gradient norms and trained weights (1e-5); with the all-to-all returning no gradient they
    differ. Then on 2 processes: TP 2 with and without SP gives one process's losses, MoE statistics, gradients (the
    load-balancing and z-losses' included) and trained weights (1e-5), and both the EP 2 x TP 2 run's checkpoint and a
    one-process MoE checkpoint give the one-process logits, greedy tokens and held-out loss under TP 2"""
    slow = 'slow' in (request.config.getoption('--nb-flags') or '').split()
    for world in (1, 4):
        spawn(_train_worker, world, str(tmp_path / f'init{world}'), str(tmp_path), free_port(), slow, tiny_data[1])
    one = torch.load(tmp_path / 'train1.pt')['one']
    assert min(one['norms']) > 0.05                                # every step clipped
    runs = torch.load(tmp_path / 'train4.pt')
    assert ('ep2 x tp2 sp' in runs) == slow
    for name in ('ep2 x tp2', 'ep2 x tp2 sp')[:1 + slow]:
        got = runs[name]
        assert got['losses'] == pytest.approx(one['losses'], rel=1e-5, abs=0), name
        assert got['norms'] == pytest.approx(one['norms'], rel=1e-5, abs=0), name
        assert one['weights'].keys() == got['weights'].keys()
        for key, w in one['weights'].items():
            assert (got['weights'][key] - w).abs().max().item() < 1e-5, (name, key)
    control = runs['control']
    assert control['losses'][0] == pytest.approx(one['losses'][0], rel=1e-5)  # the first forward is untouched
    assert control['norms'][0] != pytest.approx(one['norms'][0], rel=1e-4)     # the gradients are not
    assert control['losses'][1:] != pytest.approx(one['losses'][1:], rel=1e-4)
    assert max((control['weights'][k] - w).abs().max().item() for k, w in one['weights'].items()) > 1e-2

    ckpts = [str(moe_checkpoint), str(tmp_path / 'ep_run')]
    text = tmp_path / 'held_out.txt'
    text.write_text(HELD_OUT)
    want = {}
    for c in ckpts:
        want[c] = _outputs(Generator.from_checkpoint(c, device='cpu'))
        want[c]['eval'] = evaluate(c, text).perplexity.loss
    assert load_model(ckpts[1]).state['ep'] == 2
    spawn(_tp_worker, 2, str(tmp_path / 'init2'), str(tmp_path), ckpts, str(text))
    for rank in range(2):
        found = torch.load(tmp_path / f'{rank}.pt')
        control = found['errors'].pop('control')
        assert control['whole_blocks'] == 0 and min(control['stats'], control['grad'], control['weights']) > 1e-3
        for (name, sp), e in found['errors'].items():
            assert max(e['loss'], e['stats'], e['grad'], e['weights']) < 1e-5, (rank, name, sp, e)
            moe_blocks = MODELS[name].layers // MODELS[name].moe_every
            assert e['whole_blocks'] == (moe_blocks if sp else 0), (rank, name, sp, e)     # sp: True or a recompute
        for c in ckpts:
            got = found['generated'][c]
            torch.testing.assert_close(torch.tensor(got['logits']), torch.tensor(want[c]['logits']), rtol=1e-5,
                                       atol=1e-5)
            assert got['greedy'] == want[c]['greedy'] and all(got['greedy']), c    # (up to 8, within the context)
            assert got['eval'] == pytest.approx(want[c]['eval'], rel=1e-6), c
