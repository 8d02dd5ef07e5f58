"""`train.compile`: the compiled blocks train like the eager ones under DeepSpeed ZeRO 0-2 and every recomputation."""
import pytest
import torch

from gptkit.train.engine import build_engine, init_distributed
from gptkit.errors import ConfigError
from gptkit.model.decoder import GPT
from gptkit.config.run import resolve


def losses(zero: int, recompute: str, compiled: bool, steps: int = 3) -> list[float]:
    cfg = resolve('tiny', sets=['model.layers=2', 'model.hidden=32', 'model.heads=2', 'model.seq_len=32', 'model.vocab=96',
                                'model.dropout=0', 'train.micro_batch=2', 'train.global_batch=2', 'train.precision=fp32',
                                f'parallel.zero={zero}', f'train.recompute={recompute}', 'optim.warmup=0',
                                'optim.lr=1e-2'])
    init_distributed()
    torch.manual_seed(0)
    model = GPT(cfg.model).set_recompute(recompute)
    if compiled: model.compile_blocks()
    engine, _ = build_engine(cfg, model, iters=steps)
    data = torch.randint(0, 96, (steps, 2, 33), generator=torch.Generator().manual_seed(1))
    out = []
    for x in data:
        loss = engine(x[:, :-1], x[:, 1:]); engine.backward(loss); engine.step()
        out.append(loss.item())
    if compiled:        # the blocks ran compiled (the first run compiled them; later ones reuse the graphs)
        assert model.blocks['0']._compiled_call_impl is not None and torch._dynamo.utils.counters['frames']['ok'] >= 1
    return out


@pytest.mark.parametrize('zero,recompute', [(0, 'none'), (1, 'full'), (2, 'none'), (2, 'selective')])
def test_compiled_blocks_train_like_eager(zero, recompute, request):
    "ZeRO 0-2, and full recomputation, reuse one compiled graph; selective recomputation compiles its own (slow)"
    if recompute == 'selective' and 'slow' not in request.config.getoption('--nb-flags').split():
        pytest.skip('slow: run with --nb-flags slow')
    eager, compiled = losses(zero, recompute, False), losses(zero, recompute, True)
    assert eager[-1] < eager[0]                                   # it learns
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5), (compiled, eager)


def test_compile_is_refused_where_it_is_not_tested():
    from gptkit.train.engine import compile_model
    cfg = resolve('tiny', sets=['parallel.tp=2', 'train.compile=true'])
    with pytest.raises(ConfigError) as e: compile_model(cfg, None)
    assert 'train.compile' in e.value.render(lambda k: k) and 'tp 2' in str(e.value.render(lambda k: k))
    with pytest.raises(ConfigError): resolve('tiny', sets=['train.compile=3'])


def test_compile_without_a_cpp_compiler_is_one_sentence(monkeypatch, tmp_path):
    from gptkit.train.engine import compile_model
    monkeypatch.setenv('PATH', str(tmp_path)); monkeypatch.delenv('CXX', raising=False)
    with pytest.raises(ConfigError) as e: compile_model(resolve('tiny', sets=['train.compile=true']), None)
    assert 'needs a C++ compiler' in e.value.render(lambda k: k)
