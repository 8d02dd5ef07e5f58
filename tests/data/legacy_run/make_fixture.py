"""Writes tests/data/legacy_run with gptkit at a0a751d: a tiny run stopped at step 3 plus what it should do next."""
import json, os, shutil, sys
from pathlib import Path
sys.path.insert(0, '/tmp/oldmain'); sys.path.insert(0, '/tmp/oldmain/tests')
import gptkit; assert gptkit.__file__.startswith('/tmp/oldmain'), gptkit.__file__
import torch
from conftest import TINY_SETS
from gptkit.config.sections import resolve
from gptkit.data.corpus import clean_text, read_documents
from gptkit.data.prepare import PrepareConfig, prepare
from gptkit.tokenizer.bpe import save_tokenizer, train_bpe
from gptkit.train.loop import train
from gptkit.checkpoint.checkpointing import load_model

w = Path('/tmp/fx/work'); shutil.rmtree(w, ignore_errors=True); w.mkdir()
docs = [x.text for x in read_documents(['builtin:kjv'])][:60]
(w / 'kjv60.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs))
save_tokenizer(train_bpe((clean_text(t) for t in docs), 512), w / 'tok')
res = prepare(PrepareConfig((str(w / 'kjv60.jsonl'),), str(w / 'data' / 'kjv'), str(w / 'tok')))
def cfg(out): return resolve(sets=TINY_SETS + ['parallel.zero=1'], overrides={'data': {'prefix': str(res.prefix), 'tokenizer': str(w / 'tok')}}, out=str(out))
full = train(cfg(w / 'full'))
half = train(cfg(w / 'run'), stop_after=3)
assert full.losses[:3] == half.losses
ids = torch.arange(0, 32 * 2).remainder(500).view(2, 32)
m = load_model(w / 'run').model.eval()
with torch.no_grad(): logits = m(ids)
torch.save({'ids': ids, 'logits': logits}, w / 'run' / 'expected_logits.pt')
(w / 'run' / 'expected.json').write_text(json.dumps({
    'written_by': 'gptkit a0a751d (tests/data/legacy_run/make_fixture.md)', 'losses_1_to_6': full.losses,
    'valid_loss': full.valid_loss, 'test_loss': full.test_loss, 'iteration': half.iteration}, indent=1))
print(full.losses, full.valid_loss, res.prefix)
