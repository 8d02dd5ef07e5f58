"""Issue 50, round two: every amount of work a generation or a request asks for is bounded where it is read (new tokens
against the context, stop strings by count and length, matched in time linear in the text), and the web page fills
its placeholders before a user's text can be read as one."""
import json
import threading
import time

import httpx
import pytest

from conftest import run_here
from gptkit.inference.batching import Limits
from gptkit.inference.generator import Generator
from gptkit.inference.sampling import STOP_CHARS, TextStream
from gptkit.serve.server import Server, page_html


@pytest.fixture(scope='module')
def gen(tiny_checkpoint):
    return Generator.from_checkpoint(tiny_checkpoint, device='cpu')


@pytest.fixture(scope='module')
def url(gen):
    # 256 prompts of 63 tokens: a body limit of about 580 KB, so a 500,000-character stop string arrives whole
    with Server(gen, Limits(max_new_tokens=16, max_prompts=256), name='tiny') as u:
        yield u


def test_generate_refuses_more_new_tokens_than_the_context_leaves(tiny_checkpoint):
    "--max-new-tokens 10**12 used to run to the context and say nothing; it is refused in one sentence"
    r = run_here('generate', '--checkpoint', tiny_checkpoint, '--prompt', 'In the', '--max-new-tokens', 10**12,
                 '--greedy')
    assert r.returncode == 2, r.stdout + r.stderr     # a flag the model cannot honour: a usage error
    said = ' '.join((r.stdout + r.stderr).split())
    assert "--max-new-tokens 1,000,000,000,000 is more than the model's context of 64 tokens leaves after the prompt" in said
    assert 'Traceback' not in said


def test_generate_without_max_new_tokens_stops_at_the_context(tiny_checkpoint):
    "The default (64) is what the context leaves after a prompt: no refusal, the sequence ends at the context"
    r = run_here('generate', '--checkpoint', tiny_checkpoint, '--prompt', 'In the', '--greedy')
    assert r.returncode == 0, r.stdout + r.stderr
    assert '(length)' in r.stdout


def test_generate_refuses_a_stop_string_too_long(tiny_checkpoint):
    r = run_here('generate', '--checkpoint', tiny_checkpoint, '--prompt', 'In the', '--stop', 'x' * 5000,
                 '--max-new-tokens', 4)
    assert r.returncode == 2, r.stdout + r.stderr     # a flag the model cannot honour: a usage error
    said = ' '.join((r.stdout + r.stderr).split())
    assert f'--stop must be at most 8 strings of at most {STOP_CHARS:,} characters each, not 1 of up to 5,000' in said


def test_stop_strings_are_matched_in_linear_time(gen):
    "A 200,000-character stop string took about 1.2 s a token (every prefix compared with the text's end)"
    stream = TextStream(gen.tok, ('a' * 200_000,))
    ids = gen.tok.encode('a' * 40)
    start = time.perf_counter()
    pieces = [stream.add(t) for t in ids]
    assert time.perf_counter() - start < 2
    assert pieces == [''] * len(ids) and stream.finish() == 'a' * 40     # held back, then let go


@pytest.mark.parametrize('path,body', [
    ('/v1/completions', {'prompt': 'And', 'max_tokens': 16, 'stop': 'x' * 500_000}),
    ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'Hi'}], 'stop': ['\n', 'x' * 500_000]}),
])
def test_a_huge_stop_string_is_refused_and_holds_no_one_up(url, path, body):
    "A 500,000-character stop string held the worker 109 s, and a 2-token request behind it waited 25 s"
    got = {}
    def send():
        got['r'] = httpx.post(url + path, json=body, timeout=20)
    sender = threading.Thread(target=send)
    sender.start()
    start = time.perf_counter()
    small = httpx.post(url + '/v1/completions', json={'prompt': 'The', 'max_tokens': 2, 'temperature': 0}, timeout=20)
    assert small.status_code == 200 and time.perf_counter() - start < 5
    sender.join(30)
    r = got['r']
    where = 'stop' if isinstance(body['stop'], str) else 'stop[1]'
    assert r.status_code == 400, r.text
    assert r.json()['error'] == {'message': f'{where} has 500,000 characters; this server takes stop strings of at '
                                            f'most {STOP_CHARS:,}', 'type': 'invalid_request_error', 'param': 'stop',
                                 'code': None}


def test_a_stop_string_at_the_limit_is_served(url):
    body = {'prompt': 'And', 'max_tokens': 8, 'temperature': 0, 'stop': ['y' * STOP_CHARS, 'z' * STOP_CHARS]}
    r = httpx.post(url + '/v1/completions', json=body, timeout=20)
    assert r.status_code == 200 and r.json()['choices'][0]['finish_reason'] == 'length', r.text


@pytest.mark.parametrize('name', ['run {{KEY}}', 'run {{CONTEXT}} {{MODEL}}'])
def test_page_placeholders_are_filled_before_the_name(name):
    "The model's name went in first, then {{CONTEXT}} and {{KEY}} were replaced inside it too"
    page = page_html(name, 64, key=False)
    assert f'<b id="model">{name}</b>, context 64 tokens' in page
    assert 'data-api-key="none"' in page and '{{' not in page.replace(name, '')


# --- a request's time limit, and new tokens against the context (the server) ---

LIMIT = 'the request ran past this server\'s limit of 0.3 s a request (--request-seconds)'


class SlowGenerator:
    "A generator whose model takes 30 ms a step: 60 new tokens take about 2 s, far past a 0.3 s limit"
    def __init__(self, gen):
        self.gen = gen

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def logits(self, ids, **kw):
        time.sleep(0.03)
        return self.gen.logits(ids, **kw)


@pytest.fixture(scope='module')
def slow_url(gen):
    # one row at a time: a second request waits behind the first until the first ends
    with Server(SlowGenerator(gen), Limits(max_new_tokens=64, max_batch=1, request_seconds=0.3), name='tiny') as u:
        yield u


@pytest.mark.parametrize('method,path,body', [
    ('POST', '/v1/completions', {'prompt': 'And', 'max_tokens': 60, 'temperature': 0}),
    ('POST', '/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 40}),
    ('PUT', '/api', {'prompts': ['And'], 'tokens_to_generate': 60}),
])
def test_a_request_past_its_time_limit_ends_and_the_next_is_answered(slow_url, method, path, body):
    "A request ran to its end however long it took, and every request behind it waited; now it ends at its limit"
    got = {}
    def send():
        got['r'] = httpx.request(method, slow_url + path, json=body, timeout=30)
        got['at'] = time.perf_counter()
    start = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.1)                                            # the long one runs; the small one waits behind it
    small = httpx.post(slow_url + '/v1/completions', json={'prompt': 'The', 'max_tokens': 2, 'temperature': 0},
                       timeout=30)
    answered = time.perf_counter() - start
    sender.join(30)
    assert small.status_code == 200 and small.json()['choices'][0]['finish_reason'] == 'length', small.text
    assert answered < 1.2 and got['at'] - start < 1.2, (answered, got['at'] - start)
    r = got['r']
    assert r.status_code == 504, r.text
    if path == '/api':
        assert r.json() == {'message': LIMIT}
    else:
        assert r.json() == {'error': {'message': LIMIT, 'type': 'server_error', 'param': None, 'code': 'timeout'}}


def test_a_stream_past_its_time_limit_sends_what_it_made_then_says_why(slow_url):
    body = {'prompt': 'In the', 'max_tokens': 60, 'temperature': 0, 'stream': True}      # a word a token
    with httpx.stream('POST', slow_url + '/v1/completions', json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith('data: {')]
    assert len(events) > 1 and all('choices' in e for e in events[:-1]), events
    assert all(e['choices'][0]['finish_reason'] is None for e in events[:-1])
    assert events[-1] == {'error': {'message': LIMIT, 'type': 'server_error', 'code': 'timeout'}}


@pytest.mark.parametrize('seconds', ['0', '-1', 'nan'])
def test_serve_refuses_a_request_limit_that_is_not_a_positive_number(tiny_checkpoint, seconds):
    r = run_here('serve', '--checkpoint', tiny_checkpoint, '--request-seconds', seconds)
    said = ' '.join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and f'--request-seconds must be more than 0, not {seconds}' in said, said
    assert 'Traceback' not in said


@pytest.fixture(scope='module')
def wide_url(gen):
    "A server that takes more new tokens than the tiny model's context of 64"
    with Server(gen, Limits(max_new_tokens=1000), name='tiny') as u:
        yield u


def _room(gen, text):
    n = len(gen.tok.encode(text))
    return n, 64 - n


@pytest.mark.parametrize('method,path,body,key,where,text', [
    ('POST', '/v1/completions', {'prompt': 'In the beginning', 'max_tokens': 500}, 'max_tokens', 'the prompt',
     'In the beginning'),
    ('POST', '/v1/completions', {'prompt': ['A', 'In the beginning'], 'max_tokens': 900}, 'max_tokens', 'prompt[1]',
     'In the beginning'),
    ('PUT', '/api', {'prompts': ['In the beginning'], 'tokens_to_generate': 500}, 'tokens_to_generate', 'the prompt',
     'In the beginning'),
    ('POST', '/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'Hi'}], 'max_completion_tokens': 500},
     'max_completion_tokens', 'the conversation', 'User: Hi\n\nAssistant:'),
])
def test_new_tokens_past_the_context_are_refused(wide_url, gen, method, path, body, key, where, text):
    "max_tokens past the context used to be cut at the context without a word; vLLM answers 400, and so does gptkit"
    n, room = _room(gen, text)
    r = httpx.request(method, wide_url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    asked = body.get(key, body.get('max_tokens'))
    said = (f"{key} {asked:,} is more than the model's context of 64 tokens leaves after {where} ({n:,} tokens): "
            f"at most {room:,}")
    if path == '/api':
        assert r.json() == {'message': said}
    else:
        assert r.json()['error'] == {'message': said, 'type': 'invalid_request_error', 'param': key, 'code': None}
    body[key] = room                                           # what the context leaves is served
    ok = httpx.request(method, wide_url + path, json=body, timeout=30)
    assert ok.status_code == 200, ok.text


def test_omitted_max_tokens_is_what_the_context_leaves(wide_url, gen):
    "Without max_tokens a long prompt gets what the context leaves (OpenAI's 'up to the context'); asked, it is refused"
    prompt = ' '.join(['the'] * 200)
    n = len(gen.tok.encode(prompt))
    prompt = gen.tok.decode(gen.tok.encode(prompt)[:60])
    n, room = _room(gen, prompt)
    assert 0 < room < 16, room
    body = {'prompt': prompt, 'temperature': 0}
    r = httpx.post(wide_url + '/v1/completions', json=body, timeout=30)
    assert r.status_code == 200 and r.json()['usage']['completion_tokens'] <= room, r.text
    asked = httpx.post(wide_url + '/v1/completions', json={**body, 'max_tokens': 16}, timeout=30)
    assert asked.status_code == 400 and asked.json()['error']['param'] == 'max_tokens', asked.text
