"""Chat where a chat model is served: /v1/models says whether the tokenizer has a chat template, the web page and
`gptkit client` then keep a conversation and send it whole to /v1/chat/completions; an OpenAI request naming a model
the server does not serve is refused as OpenAI refuses it."""
import json

import httpx
import pytest
from typer.testing import CliRunner

from gptkit.inference.batching import Limits
from gptkit.inference.generator import Generator
from gptkit.serve.guard import Access
from gptkit.inference.sampling import Sampling
from gptkit.serve.server import Server
from test_serve import _chromium

LIMITS = Limits(max_new_tokens=16, max_prompts=4, max_waiting=8)
KEY = 's3cret'
AUTH = {'Authorization': f'Bearer {KEY}'}
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
BROWSER_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                '--disable-background-networking', '--disable-component-update', '--disable-sync']


class Recorder:
    "Keeps the body of each request to /v1/chat/completions, as the server received it"
    def __init__(self, app, bodies: list):
        self.app, self.bodies = app, bodies

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http' or scope['path'] != '/v1/chat/completions':
            return await self.app(scope, receive, send)
        chunks = []
        async def tap():
            m = await receive()
            chunks.append(m.get('body', b''))
            if m['type'] == 'http.request' and not m.get('more_body'):
                self.bodies.append(json.loads(b''.join(chunks)))
            return m
        return await self.app(scope, tap, send)


@pytest.fixture(scope='module')
def chat_server(tiny_checkpoint):
    "(url, bodies): a server, with an API key, of the tiny model whose tokenizer has a chat template; the chat bodies"
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu')
    gen.tok.chat_template = TEMPLATE
    server, bodies = Server(gen, LIMITS, name='tiny-chat', access=Access(api_key=KEY)), []
    server.app.add_middleware(Recorder, bodies=bodies)
    with server as u: yield u, bodies


@pytest.fixture(scope='module')
def chat_url(chat_server):
    return chat_server[0]


@pytest.fixture(scope='module')
def plain(tiny_checkpoint):
    "(url, generator): a server of the tiny model without a chat template, and no key"
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu')
    with Server(gen, LIMITS, name='tiny') as u: yield u, gen


@pytest.fixture(scope='module')
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=BROWSER_ARGS)
        try: yield b
        finally: b.close()


def reply(url, messages):
    "The greedy reply of the chat server to `messages`, asked directly"
    body = {'messages': messages, 'max_completion_tokens': 8, 'temperature': 0}
    r = httpx.post(url + '/v1/chat/completions', json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()['choices'][0]['message']['content']


@pytest.mark.parametrize('path,body', [('/v1/completions', {'prompt': 'And the', 'max_tokens': 2}),
                                       ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'Hi'}],
                                                                 'max_tokens': 2})])
def test_an_unknown_model_is_refused_in_openais_shape(plain, path, body):
    url = plain[0]
    r = httpx.post(url + path, json={**body, 'model': 'gpt-4o'})
    assert r.status_code == 404, r.text
    assert r.json() == {'error': {'message': 'The model `gpt-4o` does not exist; this server serves `tiny`',
                                  'type': 'invalid_request_error', 'param': 'model', 'code': 'model_not_found'}}
    for named in ({'model': 'tiny'}, {}):                     # the served name, or none, as before
        r = httpx.post(url + path, json={**body, **named}, timeout=60)
        assert r.status_code == 200, r.text
    from openai import NotFoundError, OpenAI
    client = OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0)
    with pytest.raises(NotFoundError) as refused:
        client.completions.create(model='tiny2', prompt='x', max_tokens=2)
    assert refused.value.code == 'model_not_found' and 'serves `tiny`' in refused.value.message


def test_models_say_whether_the_model_chats(chat_url, plain):
    listed = httpx.get(chat_url + '/v1/models', headers=AUTH).json()['data'][0]
    assert (listed['id'], listed['chat_template'], listed['max_model_len']) == ('tiny-chat', True, 64)
    assert httpx.get(plain[0] + '/v1/models').json()['data'][0]['chat_template'] is False


def client(url, typed, *args):
    from gptkit_cli.main import app
    r = CliRunner().invoke(app, ['client', url, '--max-tokens', '8', '--temperature', '0', '--api-key', KEY, *args],
                           input=typed)
    assert r.exit_code == 0, (r.stdout, r.stderr, r.exception)
    return r.stdout


def test_the_client_chats_keeping_the_history(chat_server):
    url, bodies = chat_server
    first, second = 'Who\nmade?', 'Then?'
    a1 = reply(url, [{'role': 'user', 'content': first}])
    a2 = reply(url, [{'role': 'user', 'content': first}, {'role': 'assistant', 'content': a1},
                     {'role': 'user', 'content': second}])
    alone = reply(url, [{'role': 'user', 'content': second}])
    assert a1 and a2 and alone
    del bodies[:]
    # a line ending with a backslash goes on; /new starts over, so the same question is then asked alone
    said = client(url, 'Who\\\nmade?\nThen?\n/new\nThen?\n\n')
    assert [b['messages'] for b in bodies] == [
        [{'role': 'user', 'content': first}],
        [{'role': 'user', 'content': first}, {'role': 'assistant', 'content': a1}, {'role': 'user', 'content': second}],
        [{'role': 'user', 'content': second}]]
    assert all(b['stream'] is True and b['model'] == 'tiny-chat' for b in bodies)
    at = [said.index(a1)]                                  # each reply printed as it came, in turn
    at.append(said.index(a2, at[0] + len(a1)))
    at.append(said.index(alone, at[1] + len(a2)))
    del bodies[:]
    raw = client(url, 'And the\n\n', '--raw')              # --raw continues the prompt, as before
    text = httpx.post(url + '/v1/completions', headers=AUTH, json={
        'prompt': 'And the', 'max_tokens': 8, 'temperature': 0}).json()['choices'][0]['text']
    assert text in raw and not bodies


def test_the_page_chats_with_a_chat_model_in_chromium(chat_url, browser):
    first, second = '<i>W</i>\nmade?', 'Then?'
    a1 = reply(chat_url, [{'role': 'user', 'content': first}])
    a2 = reply(chat_url, [{'role': 'user', 'content': first}, {'role': 'assistant', 'content': a1},
                          {'role': 'user', 'content': second}])
    page = browser.new_page()
    sent = []
    page.on('request', lambda q: sent.append(json.loads(q.post_data)) if q.url.endswith('/v1/chat/completions') else 0)
    page.goto(chat_url + '/')
    assert page.is_visible('#chat_mode') and page.is_hidden('#completion_mode') and page.is_hidden('#generate')
    assert page.text_content('#endpoint') == '/v1/chat/completions'
    page.fill('#api_key', KEY)
    page.fill('#max_tokens', '8')
    page.fill('#temperature', '0')
    page.click('#message')
    page.keyboard.type('<i>W</i>')
    page.keyboard.press('Shift+Enter')                     # a new line, not a send
    page.keyboard.type('made?')
    assert not sent
    page.keyboard.press('Enter')
    page.wait_for_selector('#turns .turn:nth-child(2)')     # the page's CSP forbids wait_for_function's eval
    page.wait_for_selector('#status[data-finish]', timeout=30000)
    page.fill('#message', second)
    page.press('#message', 'Enter')
    page.wait_for_selector('#turns .turn:nth-child(4)')     # the page's CSP forbids wait_for_function's eval
    page.wait_for_selector('#status[data-finish]', timeout=30000)
    assert page.get_attribute('#status', 'data-finish') in ('length', 'stop'), page.text_content('#status')
    turns = [(t.get_attribute('data-role'), t.text_content()) for t in page.query_selector_all('#turns .turn')]
    assert turns == [('user', first), ('assistant', a1), ('user', second), ('assistant', a2)]
    assert page.locator('#turns i').count() == 0           # text, never HTML
    assert [m['messages'] for m in sent] == [[{'role': 'user', 'content': first}],
                                             [{'role': 'user', 'content': first}, {'role': 'assistant', 'content': a1},
                                              {'role': 'user', 'content': second}]]
    assert all(m['stream'] is True for m in sent)
    page.click('#new')
    assert page.locator('#turns .turn').count() == 0
    page.close()


def test_the_page_without_a_chat_template_continues_prompts(plain, browser):
    url, gen = plain
    want = gen.complete(['And God said'], Sampling(max_new_tokens=12, greedy=True))[0].text
    page = browser.new_page()
    page.goto(url + '/')
    assert page.get_attribute('body', 'data-chat') == 'none' and page.locator('#chat_mode').count() == 1
    assert page.is_hidden('#chat_mode') and page.is_hidden('#send') and page.is_visible('#prompt')
    page.fill('#prompt', 'And God said')
    page.fill('#max_tokens', '12')
    page.fill('#temperature', '0')
    page.click('#generate')
    page.wait_for_selector('#status[data-finish]', timeout=30000)
    assert page.text_content('#output') == 'And God said' + want
    page.close()
