"""The parameter table against the real model: names, shapes and order for every preset, and `count_params` per
rank against the tensors each rank of every TP x PP layout and balance holds (big presets on the meta device)."""
import pytest
import torch

from gptkit.config.sections import PRESETS, ModelConfig
from gptkit.estimate.sizing import count_params
from gptkit.config.layout import Layout
from gptkit.model.decoder import GPT
from gptkit.parallel.groups import shard_weights
from gptkit.config.params import INIT_GROUPS, TP_ROLES, param_table, stage_layers


def _meta_state(cfg: ModelConfig) -> dict:
    with torch.device('meta'): return GPT(cfg).state_dict()


def _layouts(cfg: ModelConfig):
    for tp in (1, 2, 8):
        if Layout(tp=tp).problems(cfg): continue
        for pp in (1, 3, 4):
            if pp <= cfg.layers: yield tp, pp


@pytest.mark.parametrize('name', list(PRESETS))
def test_the_table_is_the_model(name):
    cfg = PRESETS[name].model
    full = _meta_state(cfg)
    table = param_table(cfg)
    assert [(p.name, p.shape) for p in table] == [(k, tuple(v.shape)) for k, v in full.items()]
    assert all(p.tp in TP_ROLES and p.init in INIT_GROUPS for p in table)
    assert count_params(cfg).total == sum(v.numel() for v in full.values())


@pytest.mark.parametrize('name', list(PRESETS))
def test_count_params_per_rank_is_what_each_rank_holds(name):
    cfg = PRESETS[name].model
    full = _meta_state(cfg)
    for tp, pp in _layouts(cfg):
        for balance in ('layers', 'parameters'):
            count = count_params(cfg, tp, pp, balance)
            padding = (cfg.padded_vocab(tp) - cfg.padded_vocab()) * cfg.hidden * (1 if cfg.tie_embeddings else 2)
            assert count.total == sum(v.numel() for v in full.values()) + padding
            for stage, (lo, hi) in enumerate(stage_layers(cfg, pp, balance)):
                want = count.stages[stage]
                # the last TP rank: its vocabulary shard ends in padding
                shard = shard_weights(full, cfg, Layout(tp=tp, pp=pp), tp_rank=tp - 1, pp_rank=stage, balance=balance)
                assert sum(t.numel() for t in shard.values()) == want.per_rank, (name, tp, pp, balance, stage)
                tied = 'head.weight' in shard and cfg.tie_embeddings        # an untied output layer is its own
                assert want.tied_copy == (shard['head.weight'].numel() if tied else 0)
                assert {int(k.split('.')[1]) for k in shard if k.startswith('blocks.')} == set(range(lo, hi))


def test_balance_by_parameters_moves_layers_off_the_embedding_stages():
    cfg = ModelConfig(layers=8, hidden=32, heads=4, seq_len=16, vocab=2000)
    even, balanced = count_params(cfg, pp=4), count_params(cfg, pp=4, balance='parameters')
    assert [s.per_rank for s in even.stages] != [s.per_rank for s in balanced.stages]
    assert balanced.per_rank_max < even.per_rank_max
    assert stage_layers(cfg, 4, 'parameters') == [(0, 1), (1, 4), (4, 7), (7, 8)]


def test_uneven_layers_are_counted_per_stage():
    cfg = ModelConfig(layers=7, hidden=64, heads=4, seq_len=32, vocab=1000)
    sizes = [hi - lo for lo, hi in stage_layers(cfg, 3)]
    assert sizes == [3, 2, 2]
    c = count_params(cfg, pp=3)
    layer = c.stages[1].split + c.stages[1].replicated       # a middle stage holds only its layers
    assert layer == 2 * (12 * 64 * 64 + 13 * 64)
