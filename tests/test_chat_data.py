"""Chat data for fine-tuning: conversations rendered with a chat template or the plain one, tokens and a loss mask
that marks exactly the assistant's replies, bad rows counted and named, the mask beside the tokens refused when it
does not fit them, and `gptkit data prepare --chat` end to end on the built-in set."""
import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import zstandard
from typer.testing import CliRunner

from gptkit.data.chat import (
    ConversationRenderer,
    held_out_questions,
    mask_prefix,
    open_mask,
    plain_chat,
    prepare_chat,
)
from gptkit.data.indexed import IndexedDataset, IndexedWriter, data_paths, read_metadata
from gptkit.data.prepare import PrepareConfig
from gptkit.errors import DataError
from gptkit.tokenizer.bpe import asset, gpt2, load_tokenizer, save_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{'role': 'system', 'content': 'You add numbers.'}, {'role': 'user', 'content': 'What is 2 plus 3?'},
     {'role': 'assistant', 'content': 'It is 5.'}, {'role': 'user', 'content': 'And 4 plus 4?'},
     {'role': 'assistant', 'content': 'That makes 8!'}],
    [{'role': 'user', 'content': 'Say  hello, twice.'}, {'role': 'assistant', 'content': ' hello hello '}],
    [{'role': 'user', 'content': 'Spell cat backwards.'}, {'role': 'assistant', 'content': 'tac'},
     {'role': 'user', 'content': 'Thanks.'}],                     # ends with a user turn: its end is not trained
]


def write_jsonl(path, rows, extra=''):
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows) + extra)
    return path


def chatml_tokenizer(folder, template=CHATML):
    "A tiny BPE with ChatML's two special tokens and a chat template, saved as a Hugging Face folder"
    texts = [m['content'] for c in CONVERSATIONS for m in c] * 20
    tok = train_bpe(texts, 300, min_frequency=1)
    tok.hf.add_special_tokens(['<|im_start|>', '<|im_end|>'])
    tok.chat_template = template
    return save_tokenizer(tok, folder)


def runs(mask):
    "[start, end) of each run of ones in a 0/1 array"
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def prepared(tmp_path, tokenizer, name='out', rows=None):
    src = write_jsonl(tmp_path / f'{name}.jsonl', [{'messages': c} for c in (rows or CONVERSATIONS)])
    cfg = PrepareConfig(inputs=(str(src),), output_prefix=str(tmp_path / name), tokenizer=str(tokenizer))
    return cfg, prepare_chat(cfg)


def test_a_chat_template_masks_exactly_the_replies_and_their_end_markers(tmp_path):
    tok = load_tokenizer(chatml_tokenizer(tmp_path / 'tok'))
    cfg, res = prepared(tmp_path, tmp_path / 'tok')
    tokens, mask = IndexedDataset(res.prefix), open_mask(res.prefix)
    assert res.template == str(tmp_path / 'tok' / 'tokenizer_config.json')
    with ConversationRenderer(tok) as r:
        for j, conv in enumerate(CONVERSATIONS):
            text = r.render(conv, False, 'a test')
            ids, m = tokens.document(j), mask.document(j)
            assert ids.tolist() == tok.hf.encode(text, add_special_tokens=False).ids + [tok.eod]   # the whole text
            replies = [x['content'] + '<|im_end|>\n' for x in conv if x['role'] == 'assistant']
            if conv[-1]['role'] == 'assistant':
                replies[-1] += '<|endoftext|>'
            assert [tok.decode(ids[a:b]) for a, b in runs(m)] == replies
            assert (m[-1] == 1) == (conv[-1]['role'] == 'assistant')
    assert tok.hf.token_to_id('<|im_end|>') in tokens.document(0).tolist()      # one id, not its characters
    assert res.trained == int(sum(mask[i].sum() for i in range(len(mask))))


def test_the_plain_template_is_the_servers_and_masks_what_follows_assistant(tmp_path):
    from gptkit.serve.http_api import plain_chat_prompt
    for conv in CONVERSATIONS:
        for k in range(1, len(conv) + 1):
            assert plain_chat(conv[:k]) == plain_chat_prompt(conv[:k])
    tok = gpt2()
    cfg, res = prepared(tmp_path, 'gpt2')
    tokens, mask = IndexedDataset(res.prefix), open_mask(res.prefix)
    assert res.template == 'the plain template'
    for j, conv in enumerate(CONVERSATIONS):
        text = plain_chat(conv, add_generation_prompt=False)
        ids, m = tokens.document(j), mask.document(j)
        assert ids.tolist() == tok.encode(text) + [tok.eod]          # the fast encoder's ids for the whole text
        replies = [' ' + x['content'] for x in conv if x['role'] == 'assistant']
        if conv[-1]['role'] == 'assistant':
            replies[-1] += '<|endoftext|>'
        assert [tok.decode(ids[a:b]) for a, b in runs(m)] == replies


def test_the_mask_has_the_tokens_lengths_and_a_mask_that_does_not_fit_is_refused(tmp_path):
    cfg, res = prepared(tmp_path, 'gpt2')
    tokens, mask = IndexedDataset(res.prefix), open_mask(res.prefix)
    assert mask.dtype == np.uint8 and set(np.unique(mask.document(0))) <= {0, 1}
    assert mask.sequence_lengths.tolist() == tokens.sequence_lengths.tolist()
    assert mask.document_indices.tolist() == tokens.document_indices.tolist()
    assert read_metadata(res.prefix)['loss_mask'] == Path(mask_prefix(res.prefix)).name
    assert open_mask(tmp_path / 'nothing_here') is None and mask_prefix('a/b') == 'a/b_loss_mask'
    lengths = tokens.sequence_lengths.tolist()
    wrong = {'fewer': ([np.ones(n, np.uint8) for n in lengths[:-1]], np.uint8, 'holds 2 sequences in 2 documents'),
             'longer': ([np.ones(n + (i == 1), np.uint8) for i, n in enumerate(lengths)], np.uint8, 'sequence 1 has'),
             'wider': ([np.ones(n, np.int32) for n in lengths], np.int32, 'holds int32 values')}
    for what, (docs, dtype, said) in wrong.items():
        with IndexedWriter(mask_prefix(res.prefix), dtype) as w:
            w.add_documents(docs)
        with pytest.raises(DataError) as e:
            open_mask(res.prefix)
        message = str(e.value)
        assert said in message and 'out_text_document_loss_mask.idx' in message and '\n' not in message, what
    data_paths(mask_prefix(res.prefix))[0].unlink()
    with pytest.raises(DataError, match='loss_mask.bin: no such file'):
        open_mask(res.prefix)


def test_bad_rows_are_counted_and_named_and_a_file_with_none_usable_writes_nothing(tmp_path):
    rows = [{'messages': CONVERSATIONS[1]},
            {'messages': [{'role': 'user', 'content': 'Hi'}]},
            {'messages': [{'role': 'tool', 'content': 'x'}, {'role': 'assistant', 'content': 'y'}]},
            {'messages': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]},
                          {'role': 'assistant', 'content': 'a cat'}]},
            {'text': 'no messages'},
            {'prompt': 'Say yes.', 'completion': 'yes'}]
    src = write_jsonl(tmp_path / 'rows.jsonl', rows, 'not json\n')
    res = prepare_chat(PrepareConfig(inputs=(str(src),), output_prefix=str(tmp_path / 'out')))
    assert res.documents == 2
    assert dict(res.tally.problems) == {'no_assistant_turn': 1, 'unknown_role': 1, 'non_text_content': 1,
                                        'no_messages': 1, 'invalid_json': 1}
    assert res.tally.examples[0].startswith(f'{src}:2: no assistant turn')
    assert any(e.startswith(f'{src}:7: invalid json') for e in res.tally.examples)
    bad = write_jsonl(tmp_path / 'bad.jsonl', rows[1:5])
    with pytest.raises(DataError, match='no usable conversation, so nothing was written') as e:
        prepare_chat(PrepareConfig(inputs=(str(bad),), output_prefix=str(tmp_path / 'bad')))
    assert 'bad.jsonl:1: no assistant turn' in str(e.value)
    assert sorted(p.name for p in tmp_path.glob('bad*')) == ['bad.jsonl']
    packed = tmp_path / 'rows.jsonl.zst'                        # compressed input reads the same
    packed.write_bytes(zstandard.ZstdCompressor().compress(src.read_bytes()))
    again = prepare_chat(PrepareConfig(inputs=(str(packed),), output_prefix=str(tmp_path / 'packed')))
    assert again.documents == 2 and again.tally.problems == res.tally.problems
    assert any(e.startswith(f'{packed}:7: invalid json') for e in again.tally.examples)
    with pytest.raises(DataError, match=r'rows.jsonl:2: no assistant turn.*\(--strict\)'):
        prepare_chat(PrepareConfig(inputs=(str(src),), output_prefix=str(tmp_path / 'strict'), strict=True))
    assert not list(tmp_path.glob('strict*'))


def test_a_template_that_is_not_prefix_consistent_or_fails_is_named(tmp_path):
    hides = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[earlier reply]"
             "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")
    chatml_tokenizer(tmp_path / 'hides', hides)
    with pytest.raises(DataError, match='does not render .*out.jsonl:1 prefix-consistently') as e:
        prepared(tmp_path, tmp_path / 'hides')
    assert str(tmp_path / 'hides' / 'tokenizer_config.json') in str(e.value)
    assert not list(tmp_path.glob('out_*'))
    refuses = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}" + CHATML
    chatml_tokenizer(tmp_path / 'refuses', refuses)
    cfg, res = prepared(tmp_path, tmp_path / 'refuses', 'two')
    assert res.documents == 2 and res.tally.problems == {'template_error': 1}
    assert 'two.jsonl:1: template error' in res.tally.examples[0] and 'no system messages' in res.tally.examples[0]


def test_a_failed_run_over_an_existing_dataset_leaves_it_whole(tmp_path):
    cfg, res = prepared(tmp_path, 'gpt2')
    before = IndexedDataset(res.prefix).sequence_lengths.tolist()
    write_jsonl(tmp_path / 'out.jsonl', [{'messages': CONVERSATIONS[0]}, {'messages': []}])
    with pytest.raises(DataError, match='add --overwrite'):
        prepare_chat(cfg)
    with pytest.raises(DataError, match=r'out.jsonl:2: no messages'):
        prepare_chat(PrepareConfig(inputs=cfg.inputs, output_prefix=cfg.output_prefix, overwrite=True, strict=True))
    assert IndexedDataset(res.prefix).sequence_lengths.tolist() == before and open_mask(res.prefix) is not None
    assert sorted(p.name for p in tmp_path.iterdir() if '.tmp' in p.name) == []
    res = prepare_chat(PrepareConfig(inputs=cfg.inputs, output_prefix=cfg.output_prefix, overwrite=True))
    assert len(open_mask(res.prefix)) == 1


def test_prepare_chat_on_the_command_line_with_the_built_in_set(tmp_path):
    from gptkit_cli.main import app
    r = CliRunner().invoke(app, ['data', 'prepare', '--chat', '-i', 'builtin:conversations', '--output-prefix',
                                 str(tmp_path / 'sft')])
    assert r.exit_code == 0, r.output
    assert 'tokens trained' in r.output and 'sft_text_document_loss_mask.bin/.idx' in r.output
    tokens, mask = IndexedDataset(tmp_path / 'sft_text_document'), open_mask(tmp_path / 'sft_text_document')
    assert tokens.num_documents == 3000 and mask.sequence_lengths.tolist() == tokens.sequence_lengths.tolist()
    r = CliRunner().invoke(app, ['data', 'prepare', '--chat', '--no-append-eod', '-i', 'builtin:conversations',
                                 '--output-prefix', str(tmp_path / 'x')])
    assert r.exit_code == 2 and 'append-eod' in r.output and 'Traceback' not in r.output
    r = CliRunner().invoke(app, ['data', 'corpora'])
    assert r.exit_code == 0 and 'builtin:conversations' in r.output


def test_the_built_in_set_is_what_its_generator_writes_and_its_held_out_questions_are_new():
    spec = importlib.util.spec_from_file_location('make_conversations', ROOT / 'tools' / 'make_conversations.py')
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    train, held = gen.build()
    assert gzip.decompress(train) == gzip.decompress(asset('corpora', 'conversations.jsonl.gz').read_bytes())
    assert held == held_out_questions().read_bytes()
    asked = {m['content'] for line in gzip.decompress(train).decode().splitlines()
             for m in json.loads(line)['messages'] if m['role'] == 'user'}
    questions = [json.loads(line) for line in held.decode().splitlines()]
    assert len(questions) == 200 and not asked & {q['question'] for q in questions}
    assert {q['skill'] for q in questions} == {'add', 'compare', 'repeat', 'reverse', 'upper'}


def test_the_server_tokenizes_a_templated_prompt_as_the_chat_data_was_tokenized(tmp_path):
    "The prompt the server makes of a conversation's first turns is the start of that conversation's training tokens"
    from types import SimpleNamespace

    from gptkit.serve.http_api import Limits, encode_prompts
    from gptkit.tokenizer.bpe import compile_chat, load_tokenizer, render_chat
    folder = chatml_tokenizer(tmp_path / 'tok')
    _, res = prepared(tmp_path, folder)
    tok = load_tokenizer(folder)
    trained = IndexedDataset(res.prefix)[0].tolist()
    prompt = render_chat(compile_chat(tok.chat_template), CONVERSATIONS[0][:-1], tok.decode([tok.eod]))
    served, = encode_prompts(SimpleNamespace(tok=tok, context=512), [prompt], Limits(), 'messages', templated=True)
    start = tok.hf.token_to_id('<|im_start|>')
    assert served == trained[:len(served)] and start in served
    assert tok.encode(prompt) != served          # read as plain text, the markers would be other tokens


def test_the_built_in_conversations_without_chat_say_to_add_it():
    from gptkit.data.corpus import builtin_path
    with pytest.raises(DataError, match=r'prepare it with gptkit data prepare --chat'):
        builtin_path('conversations')


def test_a_plain_prepare_over_a_chat_dataset_removes_its_loss_mask(tmp_path):
    "The mask described the old tokens: a text prepared --overwrite at the same prefix must not keep it"
    from gptkit.data.prepare import prepare
    cfg, res = prepared(tmp_path, 'gpt2')
    assert open_mask(res.prefix) is not None
    (tmp_path / 'plain.txt').write_text('In the beginning God created the heaven and the earth.\n')
    prepare(PrepareConfig(inputs=(str(tmp_path / 'plain.txt'),), output_prefix=cfg.output_prefix, tokenizer='gpt2',
                          overwrite=True))
    assert open_mask(res.prefix) is None and not list(tmp_path.glob('*_loss_mask.*'))
