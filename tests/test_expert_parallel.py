"""Expert parallelism: parallel.ep checked against the model and the processes before any starts, refused where
training does not run it, and the all-to-all MoE layer equal to the one-process layer on gloo processes."""
import pytest
from typer.testing import CliRunner

from gptkit.errors import ConfigError
from gptkit.runconfig import from_dict, resolve
from gptkit_cli.main import app

MOE = {'layers': 2, 'hidden': 32, 'heads': 4, 'seq_len': 16, 'vocab': 64, 'moe_experts': 4, 'moe_top_k': 2}


@pytest.mark.parametrize('model, ep, said', [
    ({**MOE, 'moe_experts': 0}, 2, 'parallel.ep 2 splits the experts of mixture-of-experts layers, and this model is '
                                   'dense'),
    ({**MOE, 'moe_experts': 6}, 4, 'parallel.ep 4 must divide the 6 experts of each MoE layer'),
])
def test_ep_is_checked_against_the_model(model, ep, said):
    with pytest.raises(ConfigError, match=said):
        from_dict({'model': model, 'parallel': {'ep': ep}})


def test_ep_must_divide_the_data_parallel_size_the_processes_give():
    run = from_dict({'model': MOE, 'parallel': {'ep': 2}})        # planned alone: its processes decide dp
    with pytest.raises(ConfigError, match='parallel.ep 2 must divide the data-parallel size 3'):
        run.for_world(3)
    tp = from_dict({'model': MOE, 'parallel': {'ep': 2, 'tp': 2}})
    with pytest.raises(ConfigError, match='parallel.ep 2 must divide the data-parallel size 1'):
        tp.for_world(2)                                           # tp 2 on two processes leaves dp 1


def test_ep_training_is_refused_until_it_runs():
    "Before the all-to-all reaches the training loop, parallel.ep > 1 is one sentence, not a run silently without EP"
    run = resolve('moe-tiny', sets=['parallel.ep=2'])
    with pytest.raises(ConfigError, match='parallel.ep 2: gptkit does not train with expert parallelism yet'):
        run.for_world(2)
    r = CliRunner().invoke(app, ['train', '--preset', 'moe-tiny', '--dry-run', '--nproc', '2',
                                 '--set', 'parallel.ep=2'])
    assert r.exit_code == 2 and 'parallel.ep 2: gptkit does not train' in ' '.join(r.output.split()), r.output
    r = CliRunner().invoke(app, ['train', '--preset', 'tiny', '--dry-run', '--nproc', '2', '--set', 'parallel.ep=2'])
    assert r.exit_code == 2 and 'this model is dense' in ' '.join(r.output.split()), r.output
