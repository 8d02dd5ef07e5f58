"""gptkit serve over real HTTP on 127.0.0.1: Megatron's and OpenAI's APIs, streaming, concurrency, disconnects, bad requests, fuzzing, the web page in Chromium."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import requests

from gptkit.inference.batching import Busy, Job, Limits, Worker
from gptkit.inference.generator import Generator
from gptkit.inference.sampling import Sampling
from gptkit.serve.server import Server

LIMITS = Limits(max_new_tokens=48, max_prompts=16, max_waiting=32)


@pytest.fixture(scope='module')
def gen(tiny_checkpoint):
    return Generator.from_checkpoint(tiny_checkpoint, device='cpu')


@pytest.fixture(scope='module')
def url(gen):
    with Server(gen, LIMITS, name='tiny') as u: yield u


def greedy(gen, prompt, n):
    return gen.complete([prompt], Sampling(max_new_tokens=n, greedy=True))[0]


def test_megatron_client_protocol(url, gen):
    "What Megatron's tools/text_generation_cli.py sends and reads: PUT, data=json.dumps, ['text'][0], ['message'] on errors"
    headers = {'Content-Type': 'application/json'}
    r = requests.put(url + '/api',
                     data=json.dumps({'prompts': ['In the beginning'], 'tokens_to_generate': 10, 'top_k': 1}),
                     headers=headers)
    assert r.status_code == 200
    want = greedy(gen, 'In the beginning', 10)
    assert r.json()['text'][0] == 'In the beginning' + want.text
    assert r.json()['tokens'][0] == want.prompt_tokens + want.tokens
    assert ''.join(r.json()['segments'][0]) == r.json()['text'][0]
    r = requests.put(url + '/api', data=json.dumps({'prompts': ['x'], 'tokens_to_generate': 'ten'}), headers=headers)
    assert r.status_code == 400 and r.json()['message'] == 'tokens_to_generate: input should be a valid integer, unable to parse string as an integer'


def test_megatron_logprobs_and_scoring(url, gen):
    r = httpx.put(url + '/api', json={'prompts': ['And God said', 'Let there'], 'tokens_to_generate': 4, 'top_k': 1, 'logprobs': True})
    res = r.json()
    for tokens, lps in zip(res['tokens'], res['logprobs']): assert len(lps) == len(tokens) - 1
    scored = httpx.put(url + '/api',
                       json={'prompts': ['And God said'], 'tokens_to_generate': 0, 'logprobs': True}).json()
    assert scored['text'] == ['And God said']
    ids = gen.tok.encode('And God said')
    assert scored['logprobs'][0] == pytest.approx(gen.score([ids])[0], abs=1e-5)
    assert res['logprobs'][0][:len(ids) - 1] == pytest.approx(scored['logprobs'][0], abs=1e-4)


@pytest.mark.parametrize('body,message', [
    ({}, 'prompts is required'),
    ({'prompts': []}, 'prompts is empty'),
    ({'prompts': ['a'] * 17}, 'Maximum number of prompts is 16'),
    ({'prompts': ['a'], 'tokens_to_generate': -1}, 'tokens_to_generate must be an integer greater than or equal to 0'),
    ({'prompts': ['a'], 'tokens_to_generate': 10**6}, 'tokens_to_generate must be at most 48 on this server'),
    ({'prompts': ['a'], 'tokens_to_generate': 0}, 'tokens_to_generate=0 implies logprobs should be True'),
    ({'prompts': ['a'], 'temperature': 0}, 'temperature must be a positive number less than or equal to 100.0'),
    ({'prompts': ['a'], 'top_k': 5, 'top_p': 0.5}, 'cannot set both top-k and top-p samplings.'),
    ({'prompts': ['a'], 'top_p': 1.5}, 'top_p must be less than or equal to 1.0'),
    ({'prompts': ['']}, 'Empty prompts require add_BOS=true'),
    ({'prompts': ['a'], 'max_len': 5}, 'max_len is not a field of this API'),
    ({'prompts': ['word ' * 100]}, re.compile(r'prompts has \d+ tokens; this server takes at most 63')),
    ({'prompts': ['a'], 'random_seed': 2**64}, 'random_seed must be a whole number from 0 to 2**63 - 1, not 18446744073709551616'),
])
def test_megatron_bad_requests(url, body, message):
    r = httpx.put(url + '/api', json=body)
    assert r.status_code == 400 and list(r.json()) == ['message'], r.text
    got = r.json()['message']
    assert message.fullmatch(got) if isinstance(message, re.Pattern) else got == message, got


def test_openai_client(url, gen):
    from openai import OpenAI
    client = OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)
    assert [m.id for m in client.models.list().data] == ['tiny']
    c = client.completions.create(model='tiny', prompt=['And the', 'For'], max_tokens=12, temperature=0)
    assert [ch.text for ch in c.choices] == [greedy(gen, p, 12).text for p in ('And the', 'For')]
    assert c.usage.completion_tokens == sum(len(greedy(gen, p, 12).tokens) for p in ('And the', 'For'))
    chunks = list(client.completions.create(model='tiny', prompt='And the', max_tokens=12, temperature=0, stream=True))
    assert ''.join(ch.choices[0].text for ch in chunks) == c.choices[0].text
    assert chunks[-1].choices[0].finish_reason in ('length', 'stop')
    n = client.completions.create(model='tiny', prompt='And', max_tokens=5, n=3, seed=7, temperature=1.0)
    assert [ch.index for ch in n.choices] == [0, 1, 2]
    again = client.completions.create(model='tiny', prompt='And', max_tokens=5, n=3, seed=7, temperature=1.0)
    assert [ch.text for ch in again.choices] == [ch.text for ch in n.choices]      # a seed makes it reproducible
    from openai import BadRequestError
    with pytest.raises(BadRequestError, match='max_tokens must be between 1 and 48'):
        client.completions.create(model='tiny', prompt='x', max_tokens=100)



def test_openai_logprobs_echo_and_stream_usage(url, gen):
    from openai import OpenAI
    client = OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)
    prompt, ids = 'And God said', gen.tok.encode('And God said')
    want = greedy(gen, prompt, 6)
    c = client.completions.create(model='tiny', prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True)
    lp = c.choices[0].logprobs
    assert c.choices[0].text == prompt + want.text
    assert len(lp.tokens) == len(ids) + len(want.tokens) and ''.join(lp.tokens) == prompt + want.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None         # nothing predicts the first token
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(gen.score([ids])[0], abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx(want.logprobs, abs=1e-4)
    for t, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) == 3 and max(top.values()) >= v - 1e-5 and list(top.values()) == sorted(top.values(), reverse=True)
    for t, v, top in zip(lp.tokens[len(ids):], lp.token_logprobs[len(ids):], lp.top_logprobs[len(ids):]):
        assert top[t] == pytest.approx(v, abs=1e-5) and v == pytest.approx(max(top.values()), abs=1e-5)   # greedy
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    plain = client.completions.create(model='tiny', prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    assert plain.choices[0].logprobs.top_logprobs is None and plain.choices[0].logprobs.text_offset[0] == len(prompt)
    events = list(client.completions.create(model='tiny', prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                            stream=True, stream_options={'include_usage': True}))
    assert events[0].choices[0].text == prompt and ''.join(e.choices[0].text for e in events[:-1]) == prompt + want.text
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == len(want.tokens)
    assert events[-1].usage.prompt_tokens == len(ids) and all(e.usage is None for e in events[:-1])
    streamed = list(client.completions.create(model='tiny', prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                              logprobs=2, stream=True))
    tokens = [t for e in streamed if e.choices[0].logprobs for t in e.choices[0].logprobs.tokens]
    assert tokens == lp.tokens and streamed[0].choices[0].logprobs.token_logprobs[0] is None


def test_a_token_that_is_part_of_a_character_is_named_by_its_bytes():
    from gptkit.serve.server import CompletionLogprobs
    from gptkit.tokenizer.bpe import gpt2
    tok = gpt2()
    ids = tok.encode('日本')                                     # 日 is two tokens: bytes e6 97, then a5
    log = CompletionLogprobs(tok, 0)
    log.add(ids, [-1.0] * len(ids), [[(ids[0], -1.0)]] + [None] * (len(ids) - 1))
    assert log.tokens[:2] == ['bytes:\\xe6\\x97', 'bytes:\\xa5'] and log.top_logprobs[0] == {'bytes:\\xe6\\x97': -1.0}


def test_chat_completions_with_the_plain_template(url, gen):
    from openai import BadRequestError, OpenAI
    from gptkit.serve.http_api import PLAIN_CHAT_STOP, plain_chat_prompt
    client = OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)
    messages = [{'role': 'system', 'content': 'You answer in verse.'}, {'role': 'user', 'content': 'Who made the earth?'}]
    prompt = plain_chat_prompt(messages)
    assert prompt == 'You answer in verse.\n\nUser: Who made the earth?\n\nAssistant:'
    want = gen.complete([prompt], Sampling(max_new_tokens=24, greedy=True, stop=(PLAIN_CHAT_STOP,)))[0]
    c = client.chat.completions.create(model='tiny', messages=messages, max_completion_tokens=24, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert c.object == 'chat.completion' and c.choices[0].message.role == 'assistant'
    assert c.choices[0].message.content == want.text.lstrip() and c.choices[0].finish_reason == want.finish_reason
    assert c.usage.prompt_tokens == len(gen.tok.encode(prompt)) and c.usage.completion_tokens == len(want.tokens)
    content = c.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(want.logprobs, abs=1e-4)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5) for e in content)
    assert b''.join(bytes(e.bytes) for e in content).decode('utf-8', 'replace').lstrip().startswith(c.choices[0].message.content[:5])
    events = list(client.chat.completions.create(model='tiny', messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={'include_usage': True}))
    assert events[0].choices[0].delta.role == 'assistant'
    assert ''.join(e.choices[0].delta.content or '' for e in events if e.choices) == c.choices[0].message.content
    assert events[-1].usage.completion_tokens == len(want.tokens)
    parts = client.chat.completions.create(model='tiny', max_tokens=24, temperature=0, messages=[
        messages[0], {'role': 'user', 'content': [{'type': 'text', 'text': 'Who made '}, {'type': 'text', 'text': 'the earth?'}]}])
    assert parts.choices[0].message.content == c.choices[0].message.content
    with pytest.raises(BadRequestError, match='top_logprobs needs logprobs set to true'):
        client.chat.completions.create(model='tiny', messages=messages, top_logprobs=2)
    with pytest.raises(BadRequestError, match='max_completion_tokens must be between 1 and 48'):
        client.chat.completions.create(model='tiny', messages=messages, max_completion_tokens=49)
    r = httpx.post(url + '/v1/chat/completions', json={'messages': [{'role': 'robot', 'content': 'x'}]})
    assert r.status_code == 400 and r.json()['error']['message'].startswith('messages.0.role: input should be')
    refusals = [([{'type': 'image_url', 'image_url': {'url': 'x'}}],
                 "messages.0.content.0: a part of type 'image_url' is not supported; this model reads text parts only"),
                (None, 'messages.0.content is required: the text of the turn')]
    for content, message in refusals:
        r = httpx.post(url + '/v1/chat/completions', json={'messages': [{'role': 'user', 'content': content}]})
        assert r.status_code == 400 and r.json()['error']['message'] == message, r.text


def test_a_tokenizers_chat_template_renders_as_transformers_renders_it(tmp_path):
    from transformers import AutoTokenizer
    from gptkit.serve.http_api import chat_prompt, chat_renderer
    from gptkit.tokenizer.bpe import gpt2, load_tokenizer, save_tokenizer
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token if false }}")
    folder = save_tokenizer(gpt2(), tmp_path / 'tok')
    (folder / 'tokenizer_config.json').write_text(json.dumps({'chat_template': template, 'eos_token': '<|endoftext|>'}))
    tok = load_tokenizer(folder)
    messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
                {'role': 'assistant', 'content': 'Hello.'}, {'role': 'user', 'content': 'Why?'}]
    theirs = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    with chat_renderer(tok, Limits(), 1024) as renderer:          # in its render process, as the server renders it
        assert chat_prompt(renderer, messages) == theirs
    assert load_tokenizer(save_tokenizer(tok, tmp_path / 'again')).chat_template == template        # kept when the tokenizer is saved

def test_stop_strings(url, gen):
    full = greedy(gen, 'And the', 20).text
    stop = full[5:8]
    r = httpx.post(url + '/v1/completions',
                   json={'prompt': 'And the', 'max_tokens': 20, 'temperature': 0, 'stop': [stop]}).json()
    assert r['choices'][0]['text'] == full[:full.find(stop)] and r['choices'][0]['finish_reason'] == 'stop'


def test_streamed_and_whole_completions_report_the_same_tokens(url, gen):
    "One reader of a job's chunks serves both answers: a token whose text is held back comes with its row's next event"
    full = greedy(gen, 'And the', 12).text
    body = {'prompt': 'And the', 'max_tokens': 12, 'temperature': 0, 'logprobs': 1, 'stop': [full + '!']}
    whole = httpx.post(url + '/v1/completions', json=body).json()['choices'][0]       # every text may start the stop
    with httpx.stream('POST', url + '/v1/completions', json={**body, 'stream': True}) as r:
        streamed = [json.loads(line[6:])['choices'][0] for line in r.iter_lines() if line.startswith('data: {')]
    assert ''.join(c['text'] for c in streamed) == whole['text'] == full
    tokens = [t for c in streamed for t in c['logprobs']['tokens']]
    assert tokens == whole['logprobs']['tokens'] and len(tokens) > len(streamed)     # held tokens came later
    assert [v for c in streamed for v in c['logprobs']['token_logprobs']] == whole['logprobs']['token_logprobs']


@pytest.mark.parametrize('body,status,message', [
    (b'{"prompt": ', 400, 'the body is not valid JSON'),
    (b'[1, 2]', 400, 'the body: input should be a valid dictionary'),
    ({'max_tokens': 4}, 400, 'prompt is required'),
    ({'prompt': 5}, 400, 'prompt.str: input should be a valid string'),
    ({'prompt': []}, 400, 'prompt must be a text or a non-empty list of texts'),
    ({'prompt': 'x', 'max_tokens': 0}, 400, 'max_tokens must be between 1 and 48'),
    ({'prompt': 'x', 'max_tokens': 10**9}, 400, 'max_tokens must be between 1 and 48'),
    ({'prompt': 'x', 'temperature': 3}, 400, 'temperature must be between 0 and 2'),
    ({'prompt': 'x', 'top_p': 0}, 400, 'top_p must be a number in (0, 1], not 0.0'),
    ({'prompt': 'x', 'top_k': -2}, 400, 'top_k must be a whole number, 0 or more, not -2'),
    ({'prompt': 'x', 'n': 0}, 400, 'n must be between 1 and 16'),
    ({'prompt': ['x'] * 9, 'n': 2}, 400, '9 prompts x n=2 is more than the 16 sequences this server takes per request'),
    ({'prompt': 'x', 'logprobs': 6}, 400, 'logprobs must be between 0 and 5'),
    ({'prompt': 'x', 'stream_options': {'include_usage': True}}, 400, 'stream_options is only allowed when stream is true'),
    ({'prompt': 'x', 'max_token': 3}, 400, 'max_token is not a field of this API'),
    ({'prompt': 'x', 'stop': ['']}, 400, 'stop must be up to 4 non-empty strings'),
    ({'prompt': 'word ' * 100}, 400, 'prompt has '),
    ({'prompt': 'x', 'seed': 2**70}, 400, 'seed must be a whole number from 0 to 2**63 - 1'),
    (b'{"prompt": "x", "temperature": NaN}', 400, 'temperature must be between 0 and 2'),
])
def test_openai_bad_requests(url, body, status, message):
    kw = {'content': body, 'headers': {'content-type': 'application/json'}} if isinstance(body, bytes) else {'json': body}
    r = httpx.post(url + '/v1/completions', **kw)
    assert r.status_code == status, r.text
    assert r.json()['error']['message'].startswith(message), r.json()
    assert r.json()['error']['type'] == 'invalid_request_error'



DEEP = b'[' * 10_000 + b']' * 10_000     # too deep for Python's parser, within the body limit
@pytest.mark.parametrize('method,path,body,status,message', [
    ('GET', '/nope', None, 404, 'Invalid URL (GET /nope): this server answers PUT /api, POST /v1/completions'),
    ('GET', '/v1/completions', None, 405, '/v1/completions does not answer GET; use POST'),
    ('POST', '/v1/completions', b'{"prompt": "\xff\xfe"}', 400, 'the body is not UTF-8 text (byte 0xff at offset 12)'),
    ('POST', '/v1/completions', DEEP, 400, 'the body nests JSON arrays or objects too deeply to parse'),
    ('PUT', '/api/x', None, 404, 'Invalid URL (PUT /api/x)'),
    ('POST', '/api', None, 405, '/api does not answer POST; use PUT'),
    ('PUT', '/api', b'{"prompts": ["\xff"]}', 400, 'the body is not UTF-8 text (byte 0xff at offset 14)'),
    ('PUT', '/api', b'{"prompts": ' + DEEP + b'}', 400, 'the body nests JSON arrays or objects too deeply to parse'),
])
def test_refusals_before_a_route_answer_in_the_api_shape(url, method, path, body, status, message):
    # Starlette refuses these before any route runs; its {"detail": ...} is neither OpenAI's nor Megatron's shape
    r = httpx.request(method, url + path, content=body, headers={'content-type': 'application/json'})
    assert r.status_code == status, r.text
    err = r.json() if path.startswith('/api') else r.json()['error']
    assert err['message'].startswith(message), r.json()
    if not path.startswith('/api'): assert err['type'] == 'invalid_request_error' and err['param'] is None

def test_concurrent_clients_are_batched_and_correct(url, gen):
    prompts = [f'And {w}' for w in ('God', 'the', 'it', 'he', 'they', 'Moses', 'Jesus', 'she', 'we', 'I', 'thou', 'ye', 'all', 'there', 'when', 'so')]
    want = {p: greedy(gen, p, 16).text for p in prompts}
    before = httpx.get(url + '/health').json()['served']
    got, errors = {}, []

    def ask(p):
        try:
            r = httpx.post(url + '/v1/completions', json={'prompt': p, 'max_tokens': 16, 'temperature': 0}, timeout=60)
            got[p] = r.json()['choices'][0]['text']
        except Exception as e: errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors and got == want
    assert httpx.get(url + '/health').json()['served'] - before == 16


@pytest.mark.parametrize('continuous', [True, False])
def test_a_request_joins_the_running_batch_at_the_next_token(gen, continuous):
    """A short request sent while a long one streams is answered before the long one ends (continuous batching; with
    continuous=False it waits for the long one), and both get the text they get alone"""
    slow, arrived, done = SlowGenerator(gen), [], {}
    long_body = {'prompt': 'And God said', 'max_tokens': 40, 'temperature': 0, 'stream': True}
    with Server(slow, Limits(max_new_tokens=48, continuous=continuous)) as u:
        def read_long():
            with httpx.stream('POST', u + '/v1/completions', json=long_body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith('data: {'): arrived.append((time.perf_counter(), json.loads(line[6:])))
        t = threading.Thread(target=read_long); t.start()
        while not arrived: time.sleep(0.01)                   # the long one is running
        short = httpx.post(u + '/v1/completions', json={'prompt': 'The', 'max_tokens': 4, 'temperature': 0}, timeout=60)
        done['short'] = time.perf_counter()
        t.join(60)
    assert short.json()['choices'][0]['text'] == greedy(gen, 'The', 4).text
    assert ''.join(e['choices'][0]['text'] for _, e in arrived) == greedy(gen, 'And God said', 40).text
    assert (done['short'] < arrived[-1][0]) == continuous, (done['short'] - arrived[-1][0])


def test_disconnect_mid_stream_does_not_hurt_others(url, gen):
    want = greedy(gen, 'In the', 40).text
    result = {}

    def steady():
        r = httpx.post(url + '/v1/completions', json={'prompt': 'In the', 'max_tokens': 40, 'temperature': 0},
                       timeout=60)
        result['text'] = r.json()['choices'][0]['text']

    with socket.create_connection((httpx.URL(url).host, httpx.URL(url).port)) as s:
        body = json.dumps({'prompt': 'And', 'max_tokens': 48, 'temperature': 1.0, 'stream': True}).encode()
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' % (len(body), body))
        t = threading.Thread(target=steady); t.start()
        received = b''
        while b'data: ' not in received: received += s.recv(4096)   # the stream started ...
    t.join(60)                                            # ... and was cut; the other request is unharmed
    assert result['text'] == want
    assert httpx.get(url + '/health').json()['status'] == 'ok'



class SlowGenerator:
    "A generator whose model takes 10 ms a row and counts the rows it runs (each one token)"
    def __init__(self, gen): self.gen, self.rows = gen, 0
    def __getattr__(self, name): return getattr(self.gen, name)
    def logits(self, ids, **kw):
        self.rows += ids.shape[0]; time.sleep(0.01 * ids.shape[0]); return self.gen.logits(ids, **kw)


def test_a_non_streaming_client_that_disconnects_stops_its_work(gen):
    body = {'prompt': 'And', 'max_tokens': 48, 'n': 16, 'temperature': 0}
    full = 16 * len(greedy(gen, 'And', 48).tokens)           # what the worker would make if nobody stopped it
    assert full >= 200
    slow = SlowGenerator(gen)
    with Server(slow, LIMITS) as u:
        with pytest.raises(httpx.ReadTimeout): httpx.post(u + '/v1/completions', json=body, timeout=0.5)
        deadline = time.time() + 20
        while httpx.get(u + '/health').json()['busy'] and time.time() < deadline: time.sleep(0.05)
        assert not httpx.get(u + '/health').json()['busy']
    assert slow.rows < full / 2, (slow.rows, full)

class FailingGenerator(SlowGenerator):
    "A slow generator whose model fails once, at the first step that runs two rows"
    failed = False
    def logits(self, ids, **kw):
        if ids.shape[0] == 2 and not self.failed:
            self.failed = True; raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB\n(simulated)')
        return super().logits(ids, **kw)


def test_a_model_failure_fails_the_running_requests_in_their_shape_and_the_server_goes_on(gen):
    failing, answers = FailingGenerator(gen), {}
    with Server(failing, LIMITS) as u:
        def ask(name, method, path, body): answers[name] = httpx.request(method, u + path, json=body, timeout=60)
        a = threading.Thread(target=ask, args=('openai', 'POST', '/v1/completions',
                                               {'prompt': 'And', 'max_tokens': 40, 'temperature': 0}))
        a.start()
        while not failing.rows: time.sleep(0.01)                 # the first request runs; the second joins it
        ask('megatron', 'PUT', '/api', {'prompts': ['The'], 'tokens_to_generate': 4})
        a.join(60)
        after = httpx.post(u + '/v1/completions', json={'prompt': 'The', 'max_tokens': 4, 'temperature': 0}, timeout=60)
    sentence = 'generation failed: CUDA out of memory. Tried to allocate 2.00 GiB'
    assert (answers['openai'].status_code, answers['openai'].json()) == (500, {'error': {
        'message': sentence, 'type': 'server_error', 'param': None, 'code': None}})
    assert (answers['megatron'].status_code, answers['megatron'].json()) == (500, {'message': sentence})
    assert after.status_code == 200 and after.json()['choices'][0]['text'] == greedy(gen, 'The', 4).text


def test_full_queue_answers_busy(gen):
    import asyncio
    w = Worker.__new__(Worker)                            # a worker whose thread never runs: its queue only fills
    w.limits, w.waiting, w.cv = Limits(max_waiting=2), __import__('collections').deque(), threading.Condition()
    loop = asyncio.new_event_loop()
    jobs = [Job(rows=[[1]], sampling=Sampling(), loop=loop, queue=None) for _ in range(3)]
    w.submit(jobs[0]); w.submit(jobs[1])
    with pytest.raises(Busy): w.submit(jobs[2])
    loop.close()



def test_bounded_load_of_mixed_clients(gen):
    "24 clients at once against 4 waiting places: each gets its answer or a 503 in the API's shape, none waits forever"
    from concurrent.futures import ThreadPoolExecutor
    bodies = [('/v1/completions', {'prompt': 'And', 'max_tokens': 8, 'temperature': 0}),
              ('/v1/completions', {'prompt': ['A', 'B'], 'max_tokens': 6, 'n': 2, 'logprobs': 2, 'echo': True}),
              ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'Who?'}], 'max_tokens': 6, 'seed': 1}),
              ('/api', {'prompts': ['And God'], 'tokens_to_generate': 0, 'logprobs': True}),
              ('/v1/completions', {'prompt': 'Why', 'max_tokens': 8, 'stream': True})]
    with Server(gen, Limits(max_new_tokens=8, max_prompts=8, max_waiting=4), name='tiny') as u:
        def call(i):
            path, body = bodies[i % len(bodies)]
            method = 'PUT' if path == '/api' else 'POST'
            if i % 7 == 6:                                     # some clients leave before the answer
                try: httpx.request(method, u + path, json=body, timeout=0.05)
                except httpx.TimeoutException: pass
                return None
            r = httpx.request(method, u + path, json=body, timeout=60)
            return path, r.status_code, r.text
        t0 = time.perf_counter()
        with ThreadPoolExecutor(24) as pool: answers = [a for a in pool.map(call, range(24)) if a]
        took = time.perf_counter() - t0
        deadline = time.time() + 30
        while httpx.get(u + '/health').json()['busy'] and time.time() < deadline: time.sleep(0.05)
        health = httpx.get(u + '/health').json()
    codes = [c for _, c, _ in answers]
    assert set(codes) == {200, 503}, codes                   # answered, or turned away: nothing else
    for path, code, text in answers:
        if code == 503:
            want = {'message': 'the server is busy; try again'} if path == '/api' else \
                   {'error': {'message': 'the server is busy; try again', 'type': 'server_error', 'param': None, 'code': None}}
            assert json.loads(text) == want
        elif path == '/v1/completions' and text.startswith('data:'): assert text.rstrip().endswith('data: [DONE]')
    assert not health['busy'] and health['waiting'] == 0 and took < 60

@pytest.fixture(scope='module')
def small_url(gen):
    "A server with small limits, so that fuzzing runs many requests quickly"
    with Server(gen, Limits(max_new_tokens=6, max_prompts=4, max_waiting=8), name='tiny') as u: yield u


def test_fuzz_http_api_against_its_openapi_schema(small_url):
    """Requests generated from the server's own OpenAPI schema by schemathesis: never a 5xx, every answer documented and well formed.

    Schemathesis' check that schema-valid data is accepted is left out: some rules cannot be said in a JSON schema
    (top_k and top_p not together, a prompt's length in tokens, Megatron's empty prompts without add_BOS)."""
    import schemathesis
    from schemathesis.specs.openapi.checks import positive_data_acceptance
    from hypothesis import HealthCheck, given, settings
    schema = schemathesis.openapi.from_url(small_url + '/openapi.json')
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f'{op.method.upper()} {op.path}' for op in operations} >= {'PUT /api', 'POST /v1/completions', 'GET /v1/models', 'GET /health'}
    for op in operations:
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, f'{case.method} {case.path} {case.body!r}: {response.status_code} {response.text}'
            case.validate_response(response, excluded_checks=[positive_data_acceptance])
        check()


def _chromium():
    path = shutil.which('chromium') or shutil.which('chromium-browser')
    if path is None:
        pytest.fail("Debian's chromium is not installed: the README's test command installs it (apt-get install chromium)")
    return path


def test_web_page_streams_in_chromium(url, gen):
    from playwright.sync_api import sync_playwright
    want = greedy(gen, 'And God said', 24).text
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
            '--disable-component-update', '--disable-sync'])
        try:
            page = browser.new_page()
            page.goto(url + '/')
            assert 'tiny' in page.text_content('#model')
            page.fill('#prompt', 'And God said')
            page.fill('#max_tokens', '24')
            page.fill('#temperature', '0')
            page.click('#generate')
            page.wait_for_selector('#status[data-finish]', timeout=30000)
            assert page.get_attribute('#status', 'data-finish') in ('length', 'stop'), page.text_content('#status')
            assert page.text_content('#completion') == want
            assert page.text_content('#output') == 'And God said' + want
            page.fill('#max_tokens', '100000')               # a bad value: the server's sentence is shown
            page.click('#generate')
            page.wait_for_selector('#status[data-finish="error"]', timeout=30000)
            assert 'max_tokens must be between 1 and 48' in page.text_content('#status')
        finally: browser.close()


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


def test_cli_serve_and_client(tiny_checkpoint, gen):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}
    proc = subprocess.Popen([sys.executable, '-m', 'gptkit_cli.main', 'serve', '--checkpoint', str(tiny_checkpoint), '--port', str(port),
                             '--max-new-tokens', '32'], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        base = f'http://127.0.0.1:{port}'
        for _ in range(300):
            try:
                if httpx.get(base + '/health', timeout=1).status_code == 200: break
            except httpx.HTTPError: time.sleep(0.1)
        else: pytest.fail('gptkit serve did not start: ' + proc.stdout.read())
        assert httpx.get(base + '/v1/models').json()['data'][0]['id'] == 'run'
        r = subprocess.run([sys.executable, '-m', 'gptkit_cli.main', 'client', base, '--max-tokens', '10', '--temperature', '0'],
                           input='And God said\n\n', capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        assert greedy(gen, 'And God said', 10).text in r.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        logs = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, logs
    assert 'Shutting down' in logs or 'Finished server process' in logs


def test_cli_client_without_server():
    r = subprocess.run([sys.executable, '-m', 'gptkit_cli.main', 'client', f'127.0.0.1:{_free_port()}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and 'does not answer as a gptkit server' in r.stderr and 'Traceback' not in r.stderr
