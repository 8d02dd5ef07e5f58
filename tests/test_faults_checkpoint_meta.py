"""A checkpoint's manifest, state and DeepSpeed config are data (issue 50): a copy of a real checkpoint, edited and
sealed again as anyone can, ends every command in one sentence naming the file and key, exit code 1, no traceback,
no hang; and a re-save of the newest iteration leaves an intact checkpoint at every point where the process can be
killed."""
import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gptkit.store import folders as store
from gptkit_cli.main import app

STEP = 'iter_0000000'


def run(*args):
    "(exit code, output on one line) of `gptkit ARGS` in this process"
    r = CliRunner().invoke(app, [str(a) for a in args])
    said = ' '.join(r.output.split())
    assert 'Traceback' not in said and not isinstance(r.exception, (TimeoutError, AssertionError)), said[-3000:]
    assert r.exit_code in (0, 1) and (r.exception is None or isinstance(r.exception, SystemExit)), repr(r.exception)
    return r.exit_code, said


def reseal(folder: Path, files: dict | None = None, **changes):
    "Seal `folder` again after its state or files changed, as anyone can (state.json's checksum is no signature)"
    state = json.loads((folder / 'state.json').read_text())
    state.update(changes, files=store.manifest(folder) if files is None else files)
    (folder / 'state.json').write_text(store.state_text(state))


@pytest.fixture
def copy(tiny_checkpoint, tmp_path) -> tuple[Path, Path]:
    "(a copy of the tiny run folder, its checkpoint folder)"
    shutil.copytree(tiny_checkpoint, tmp_path / 'run')
    return tmp_path / 'run', tmp_path / 'run' / 'checkpoints' / STEP


@contextmanager
def within(seconds: float):
    "Fail the block (a blocked open of a FIFO included) if it takes longer than `seconds`"
    def late(*_):
        raise TimeoutError(f'still running after {seconds} s')
    before = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


# File names in the manifest, and the files in the folder

def _outside(folder: Path, how: str) -> str:
    "A manifest entry for /etc/hostname, named `how`"
    if how == 'dotdot':
        return os.path.relpath('/etc/hostname', folder)          # ../../../../../etc/hostname
    if how == 'absolute':
        return '/etc/hostname'
    (folder / 'hostname').symlink_to('/etc/hostname')
    return 'hostname'


@pytest.mark.parametrize('how', ['dotdot', 'absolute', 'link'])
def test_a_manifest_entry_outside_the_checkpoint_is_refused_unread(copy, how):
    run_folder, folder = copy
    files = store.manifest(folder)
    name = _outside(folder, how)
    files[name] = {'size': os.path.getsize('/etc/hostname'), 'sha256': store._sha256(Path('/etc/hostname'))}
    reseal(folder, files)
    code, out = run('checkpoint', 'inspect', folder, '--json')
    assert code == 1 and 'hostname' in out and 'outside the checkpoint folder' in out, out[-3000:]
    assert f'{folder} is not a usable checkpoint' in out, out[-3000:]
    code, out = run('checkpoint', 'inspect', run_folder)             # the run: its one checkpoint is skipped
    assert code == 1 and f'{run_folder / "checkpoints"} holds no intact checkpoint' in out, out[-3000:]


def test_a_state_json_that_links_out_of_the_checkpoint_is_refused_unread(copy, tmp_path):
    _, folder = copy
    (folder / 'state.json').rename(tmp_path / 'elsewhere.json')         # a whole, sealed state: but not the folder's
    (folder / 'state.json').symlink_to(tmp_path / 'elsewhere.json')
    code, out = run('checkpoint', 'inspect', folder)
    said = f'{folder / "state.json"} is a link to {tmp_path / "elsewhere.json"}, outside the checkpoint folder'
    assert code == 1 and said in out, out[-3000:]


def test_a_fifo_in_an_older_checkpoint_without_a_manifest_blocks_no_command(copy):
    run_folder, folder = copy
    state = json.loads((folder / 'state.json').read_text())
    del state['checksum'], state['files']                        # as an older gptkit wrote it: accepted
    (folder / 'state.json').write_text(json.dumps(state))
    (folder / 'mp_rank_00_model_states.pt').unlink()
    os.mkfifo(folder / 'mp_rank_00_model_states.pt')             # opening it waits for a writer forever
    for args in (['checkpoint', 'inspect', folder],
                 ['generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2']):
        with within(30):
            code, out = run(*args)
        assert code == 1 and f'{folder / "mp_rank_00_model_states.pt"} is a pipe (FIFO), not a file' in out, out[-999:]


def test_a_torch_file_that_is_a_fifo_is_refused_unopened(tmp_path):
    from gptkit.store.torch_files import read_torch_file
    os.mkfifo(tmp_path / 'model.pt')
    with within(10):
        with pytest.raises(store.CheckpointError, match='model.pt was not loaded: it is not a regular file'):
            read_torch_file(tmp_path / 'model.pt')


# Values in state.json

@pytest.mark.parametrize('key,value,said', [
    ('iteration', '../../x', "iteration must be a whole number from 0 to 1,000,000,000, not '../../x'"),
    ('iteration', 10**30, 'iteration must be a whole number from 0 to 1,000,000,000, not 1' + '0' * 30),
    ('iteration', -5, 'iteration must be a whole number from 0 to 1,000,000,000, not -5'),
    ('iteration', True, 'iteration must be a whole number from 0 to 1,000,000,000, not True'),
    ('tokens', 'lots', "tokens must be a whole number from 0 to 9,223,372,036,854,775,807, not 'lots'"),
    ('consumed_samples', 2.5, 'consumed_samples must be a whole number from 0'),
    ('world_size', 0, 'world_size must be a whole number from 1'),
    ('shapes', {'wte.weight': ['x']}, 'shapes must give each weight a list of at most 8 whole numbers'),
    ('weights_only', 'no', "weights_only must be true or false, not 'no'"),
])
def test_state_values_are_checked_as_data_by_inspect_and_reshard(copy, key, value, said):
    run_folder, folder = copy
    reseal(folder, **{key: value})
    for args in (['checkpoint', 'inspect', folder], ['checkpoint', 'reshard', folder, run_folder.parent / 'out']):
        code, out = run(*args)
        assert code == 1 and f'{folder / "state.json"}: {said}' in out, out[-3000:]
    assert not (run_folder.parent / 'out').exists()               # no iter_-000005 written


def test_a_state_without_an_iteration_is_refused(copy):
    _, folder = copy
    state = json.loads((folder / 'state.json').read_text())
    del state['iteration']
    (folder / 'state.json').write_text(store.state_text(state))
    code, out = run('checkpoint', 'inspect', folder)
    assert code == 1 and f'{folder / "state.json"} has no iteration' in out, out[-3000:]


# The DeepSpeed config against the files present

def test_a_zero3_claim_over_zero0_files_is_one_sentence_in_export_and_generate(copy, tmp_path):
    run_folder, folder = copy
    ds = json.loads((folder / 'ds_config.json').read_text())
    ds['zero_optimization']['stage'] = 3
    (folder / 'ds_config.json').write_text(json.dumps(ds))
    shutil.copy(folder / 'rng_rank_000.pt', folder / 'zero_pp_rank_0_mp_rank_00_optim_states.pt')
    reseal(folder)
    said = (f'{folder / "ds_config.json"}: zero_optimization.stage is 3, but {folder} holds no ZeRO-3 model states '
            '(zero_pp_rank_N_mp_rank_00_model_states.pt)')
    for args in (['checkpoint', 'export', run_folder, tmp_path / 'hf', '--to', 'hf'],
                 ['generate', '--checkpoint', run_folder, '--prompt', 'In the', '--max-new-tokens', '2']):
        code, out = run(*args)
        assert code == 1 and said in out, out[-3000:]
    assert not (tmp_path / 'hf').exists()


# A re-save of the newest iteration, killed at each step

class Killed(BaseException):
    "The process was SIGKILLed here: nothing after this point runs, no cleanup either"


@contextmanager
def killed_at(root: Path, k: int):
    """Inside the block the process dies at the `k`-th point (0 the first) where an entry of folder `root` changes:
    before each rename, before each folder removal and half way through it (its state.json gone first, the worst
    order); once dead, no file changes anywhere. Yields the count of points passed."""
    real = {'replace': os.replace, 'rename': os.rename, 'rmtree': shutil.rmtree}
    seen = {'n': 0, 'dead': False}

    def point():
        if seen['dead'] or seen['n'] == k:
            seen['dead'] = True
            raise Killed
        seen['n'] += 1

    def mine(path) -> bool:
        if seen['dead']:
            raise Killed
        return Path(path).parent == root

    def renamed(how):
        def change(src, dst, *a, **kw):
            if mine(src) or mine(dst):
                point()
            return real[how](src, dst, *a, **kw)
        return change

    def rmtree(path, *a, **kw):
        if mine(path):
            point()
            try:
                point()
            except Killed:
                p = Path(path)
                if p.is_dir():
                    (p / 'state.json').unlink(missing_ok=True)
                    for f in sorted(x for x in p.rglob('*') if x.is_file())[::2]:
                        f.unlink()
                raise
        return real['rmtree'](path, *a, **kw)

    os.replace, os.rename, shutil.rmtree = renamed('replace'), renamed('rename'), rmtree
    try:
        yield seen
    finally:
        os.replace, os.rename, shutil.rmtree = real['replace'], real['rename'], real['rmtree']


@pytest.fixture(scope='module')
def engine_run(tiny_checkpoint, tmp_path_factory):
    "(a DeepSpeed engine of the tiny model, its RunConfig and DeepSpeed config, a run folder holding iter 0 and 1)"
    from gptkit.checkpoint.checkpointing import read_config, save
    from gptkit.train.engine import build_engine, init_distributed
    from gptkit.model.decoder import GPT
    run_folder = tmp_path_factory.mktemp('resave') / 'run'
    shutil.copytree(tiny_checkpoint, run_folder)
    cfg = read_config(run_folder / 'checkpoints' / STEP)
    init_distributed()
    engine, ds = build_engine(cfg, GPT(cfg.model), iters=cfg.iters)
    save(engine, run_folder / 'checkpoints', 1, client=CLIENT, cfg=cfg, ds_config=ds,
         tokenizer_dir=run_folder / 'tokenizer')
    return engine, cfg, ds, run_folder


CLIENT = {'iteration': 1, 'consumed_samples': 4, 'tokens': 256}


def _intact(run_folder: Path) -> Path:
    "The checkpoint `find` takes for `run_folder`, checked to be the whole iteration 1"
    folder = store.find(run_folder)
    assert store.newest(run_folder / 'checkpoints') == folder and store.verify(folder) is None
    assert store.read_state(folder)['iteration'] == 1, f'{folder} is taken, not iteration 1'
    return folder


def test_a_resave_of_the_newest_iteration_killed_at_any_step_leaves_it_intact(engine_run, tmp_path):
    from gptkit.checkpoint.checkpointing import load, save
    engine, cfg, ds, base = engine_run
    for k in range(40):
        run_folder = tmp_path / f'k{k}'
        shutil.copytree(base, run_folder)
        root = run_folder / 'checkpoints'
        with killed_at(root, k) as seen:
            try:
                save(engine, root, 1, client=CLIENT, cfg=cfg, ds_config=ds, tokenizer_dir=run_folder / 'tokenizer')
            except Killed:
                pass
        taken = _intact(run_folder)                                 # inspect, generate, a resume's plan
        with store.lock_run(run_folder):                            # the next run: its temporaries swept
            store.remove_temporaries(run_folder)
        state = load(engine, taken)                                 # planned before the sweep, loaded after it
        assert state['iteration'] == 1
        assert _intact(run_folder) == root / 'iter_0000001'
        left = sorted(p.name for p in root.iterdir() if p.name.startswith(('.', 'iter_')))
        assert left == ['iter_0000000', 'iter_0000001'], left
        if not seen['dead']:
            break
    assert k >= 6, f"the save passed only {k} points where it could be killed"


def test_what_an_earlier_resave_killed_while_deleting_left_is_found_and_put_back(copy):
    "The old save removed iter_N before renaming its new copy: killed then, iter_N had lost state.json"
    run_folder, folder = copy
    root = folder.parent
    shutil.copytree(folder, root / 'iter_0000001')
    reseal(root / 'iter_0000001', iteration=1)
    shutil.copytree(root / 'iter_0000001', root / '.tmp-iter_0000001')   # the complete new copy
    (root / 'iter_0000001' / 'state.json').unlink()                      # what the kill left of the old one
    (root / 'iter_0000001' / 'mp_rank_00_model_states.pt').unlink()
    code, out = run('checkpoint', 'inspect', run_folder, '--json')
    assert code == 0 and json.loads(out[out.index('{'):])['iteration'] == 1, out[-3000:]
    assert store.find(run_folder) == root / '.tmp-iter_0000001'
    assert store.stale_temporaries(run_folder) == []              # it is the checkpoint, not a temporary
    with store.lock_run(run_folder):
        store.remove_temporaries(run_folder)                     # with an older checkpoint there: not swept
    assert store.find(run_folder) == root / 'iter_0000001' and store.verify(root / 'iter_0000001') is None
    assert sorted(p.name for p in root.iterdir()) == ['iter_0000000', 'iter_0000001', 'latest']
