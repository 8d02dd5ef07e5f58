"""gptkit serve as an attacker or a careless client meets it, over real HTTP: a hostile model name in the web page, bodies
and prompts over the limits, foreign Host headers, API keys, clients that leave mid-body, SIGTERM while requests are
still arriving, and bad --host/--name values on the command line.

Most cases run against one real `gptkit serve` process (started once for the module, with an API key from
GPTKIT_API_KEY, an extra allowed host and a name that is both HTML and rich markup) and read its captured log."""
import html
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import run_here
from gptkit.inference.batching import Limits
from gptkit.serve.guard import Access
from gptkit.serve.http_api import body_limit, prompt_chars
from gptkit.serve.server import Server
from test_serve import SlowGenerator, _chromium, _free_port, gen, greedy  # noqa: F401  (gen: a module-scoped fixture)

KEY = 's3cret-Key'
NAME = '[/]oops <img src=x onerror=alert(document.domain)>'
LIMITS = dict(max_new_tokens=16, max_prompts=4)
AUTH = {'authorization': f'Bearer {KEY}'}


class Served:
    "A `gptkit serve` process: its url, port, process and log"
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log_path = proc, port, log
        self.url = f'http://127.0.0.1:{port}'

    def log(self) -> str:
        return self.log_path.read_text(errors='replace')


def serve_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}
    return {**env, 'COLUMNS': '200'}


def serving(checkpoint, log, *options: str, env: dict | None = None):
    "A `gptkit serve` process of `checkpoint` with `options`, logging to `log`, once healthy; killed after the module"
    port = _free_port()
    with open(log, 'w') as f:
        proc = subprocess.Popen([sys.executable, '-m', 'gptkit_cli.main', 'serve', '--checkpoint', str(checkpoint),
                                 '--port', str(port), *options], stdout=f, stderr=subprocess.STDOUT,
                                env=env or serve_env())
    s = Served(proc, port, log)
    try:
        wait_until_healthy(s)
        yield s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope='module')
def served(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp('serve') / 'serve.log'
    yield from serving(tiny_checkpoint, log, '--name', NAME, '--allowed-host', 'example.test',
                       '--max-new-tokens', str(LIMITS['max_new_tokens']), '--max-prompts', str(LIMITS['max_prompts']),
                       env={**serve_env(), 'GPTKIT_API_KEY': KEY})


def wait_until_healthy(s: Served):
    "Wait (30 s at most) until the server answers /health; fail the test with its log if it stops or never answers"
    for _ in range(300):
        if s.proc.poll() is not None:
            pytest.fail('gptkit serve stopped: ' + s.log())
        try:
            if httpx.get(s.url + '/health', timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    pytest.fail('gptkit serve did not start: ' + s.log())


def send_raw(port: int, head: str, body: bytes = b'') -> socket.socket:
    "A connection that has sent `head` (request line and headers, without the blank line) and `body` as given"
    s = socket.create_connection(('127.0.0.1', port), timeout=5)
    s.sendall(head.replace('\n', '\r\n').encode() + b'\r\n\r\n' + body)
    return s


def read_answer(s: socket.socket, timeout: float = 3) -> tuple[int, dict]:
    "The status and JSON body of the answer on `s`"
    s.settimeout(timeout)
    got = b''
    while b'\r\n\r\n' not in got:
        more = s.recv(65536)
        if not more: raise ConnectionError(f'closed after {got!r}')
        got += more
    head, _, body = got.partition(b'\r\n\r\n')
    size = int(next(line.split(b':')[1] for line in head.split(b'\r\n') if line.lower().startswith(b'content-length')))
    while len(body) < size: body += s.recv(65536)
    return int(head.split()[1]), json.loads(body[:size])


def rss_mb(pid: int) -> float:
    return int(next(line.split()[1] for line in open(f'/proc/{pid}/status') if line.startswith('VmRSS'))) / 1024


def no_traceback(log: str):
    "The server's log has no traceback, no exception and no error line"
    for bad in ('Traceback', 'Exception', 'ERROR:'):
        assert bad not in log, log[-3000:]


def test_the_name_is_printed_as_given_and_the_page_escapes_it(served):
    "`--name` holds rich markup and HTML: the banner prints it as written, the page shows it as text, and says no script"
    banner = served.log()
    assert NAME in banner and 'MarkupError' not in banner, banner
    r = httpx.get(served.url + '/')                          # the page itself needs no key
    assert r.status_code == 200
    assert '<img' not in r.text and f'gptkit: {html.escape(NAME)}</title>' in r.text
    assert f'<b id="model">{html.escape(NAME)}</b>' in r.text
    assert '<script>' not in r.text and '<script src="/static/serve.js" defer></script>' in r.text
    csp = [p.strip() for p in r.headers['content-security-policy'].split(';')]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
    assert 'unsafe-inline' not in r.headers['content-security-policy']
    assert r.headers['x-content-type-options'] == 'nosniff' and r.headers['x-frame-options'] == 'DENY'
    js = httpx.get(served.url + '/static/serve.js')
    assert js.status_code == 200 and js.headers['content-type'].startswith('text/javascript') and 'textContent' in js.text
    assert httpx.get(served.url + '/static/../serve.py').status_code == 404


def test_the_page_runs_no_injected_script_and_works_with_the_key_in_chromium(served, gen):
    from playwright.sync_api import sync_playwright
    want = greedy(gen, 'And God said', 8).text
    dialogs, violations = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
            '--disable-component-update', '--disable-sync'])
        try:
            page = browser.new_page()
            page.on('dialog', lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on('console', lambda m: violations.append(m.text) if 'Content Security Policy' in m.text else None)
            page.goto(served.url + '/')
            page.wait_for_load_state('load')
            assert page.title() == f'gptkit: {NAME}' and page.text_content('#model') == NAME
            assert page.is_visible('#api_key')                   # the server has a key: the page asks for it
            page.fill('#prompt', 'And God said')
            page.fill('#max_tokens', '8')
            page.fill('#temperature', '0')
            page.click('#generate')                              # without the key: the server's sentence
            page.wait_for_selector('#status[data-finish="error"]', timeout=30000)
            assert 'API key' in page.text_content('#status')
            page.fill('#api_key', KEY)
            page.click('#generate')
            page.wait_for_selector('#status[data-finish]:not([data-finish="error"])', timeout=30000)
            assert page.text_content('#completion') == want, page.text_content('#status')
        finally: browser.close()
    assert dialogs == [] and violations == [], (dialogs, violations)


@pytest.mark.parametrize('method,path', [('POST', '/v1/completions'), ('PUT', '/api')])
def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(served, method, path):
    limit = body_limit(Limits(**LIMITS), 64)
    t0 = time.perf_counter()
    with send_raw(served.port, f'{method} {path} HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n'
                               f'Content-Type: application/json\nContent-Length: 200000000') as s:
        status, answer = read_answer(s)                     # nothing of the 200 MB was sent
    assert time.perf_counter() - t0 < 3 and status == 413
    message = answer['message'] if path == '/api' else answer['error']['message']
    assert list(answer) == (['message'] if path == '/api' else ['error'])
    assert message.startswith(f'the body has 200,000,000 bytes; this server takes at most {limit:,} bytes (--max-prompts'), message


def test_a_chunked_body_is_cut_off_at_the_limit_and_memory_stays_flat(served):
    limit, chunk = body_limit(Limits(**LIMITS), 64), b'a' * 65536
    before = rss_mb(served.proc.pid)
    sent, answered = 0, False
    with send_raw(served.port, f'POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n'
                               'Content-Type: application/json\nTransfer-Encoding: chunked', b'') as s:
        s.sendall(b'%x\r\n{"prompt": "\r\n' % len(b'{"prompt": "'))
        while sent < 64 * 2**20:                             # up to 64 MB, stopping when the server answers
            s.sendall(b'%x\r\n%s\r\n' % (len(chunk), chunk))
            sent += len(chunk)
            readable = select.poll()                         # poll: select() refuses descriptors above 1023
            readable.register(s, select.POLLIN)
            if readable.poll(0):
                answered = True
                break
        assert answered, f'no answer after {sent:,} bytes'
        status, answer = read_answer(s)
    assert status == 413 and sent < 32 * 2**20, (status, sent)      # (socket buffers may take a few MB at once)
    assert answer['error']['message'] == (f'the body has more than {limit:,} bytes; this server takes at most {limit:,} '
                                          'bytes (--max-prompts x --max-prompt-tokens x 32 bytes, and 64 KiB for the other fields)')
    assert rss_mb(served.proc.pid) - before < 40
    assert httpx.get(served.url + '/health').json()['status'] == 'ok'


class CountingTokenizer:
    "A tokenizer that records the length of every text it encodes"
    def __init__(self, tok): self.tok, self.seen = tok, []
    def __getattr__(self, name): return getattr(self.tok, name)
    def encode(self, text):
        self.seen.append(len(text))
        return self.tok.encode(text)


class WithTokenizer:
    "A generator with another tokenizer"
    def __init__(self, gen, tok): self.gen, self.tok = gen, tok
    def __getattr__(self, name): return getattr(self.gen, name)


def test_an_over_long_prompt_is_refused_before_it_is_tokenized(gen, served):
    tok = CountingTokenizer(gen.tok)
    most = prompt_chars(gen.tok, Limits(**LIMITS), gen.context)
    long = 'And ' * (most // 4 + 1)
    with Server(WithTokenizer(gen, tok), Limits(**LIMITS)) as u:
        r = httpx.post(u + '/v1/completions', json={'prompt': ['And', long]})
        m = httpx.put(u + '/api', json={'prompts': [long]})
        c = httpx.post(u + '/v1/chat/completions', json={'messages': [{'role': 'user', 'content': long}]})
        ok = httpx.post(u + '/v1/completions', json={'prompt': 'And', 'max_tokens': 2})
    sentence = f'has {len(long):,} characters; this server takes at most 63 tokens, which is at most {most:,} characters'
    assert (r.status_code, r.json()['error']['message'], r.json()['error']['param']) == (400, 'prompt[1] ' + sentence, 'prompt')
    assert (m.status_code, m.json()) == (400, {'message': 'prompts ' + sentence})
    assert c.status_code == 400 and c.json()['error']['message'].startswith('messages has ')
    assert ok.status_code == 200
    assert max(tok.seen) < len(long), tok.seen               # the long texts never reached the tokenizer
    r = httpx.post(served.url + '/v1/completions', headers=AUTH, json={'prompt': 'x' * 10_000})
    assert r.status_code == 400 and 'characters; this server takes at most 63 tokens' in r.json()['error']['message']


@pytest.mark.parametrize('method,path', [('GET', '/health'), ('GET', '/'), ('POST', '/v1/completions'), ('PUT', '/api')])
def test_a_host_the_server_does_not_answer_to_is_refused(served, method, path):
    "DNS rebinding: a page on evil.example that points its name at 127.0.0.1 sends Host: evil.example"
    body = {'prompts': ['And']} if path == '/api' else {'prompt': 'And', 'max_tokens': 2}
    kw = {'json': body} if method != 'GET' else {}
    r = httpx.request(method, served.url + path, headers={**AUTH, 'host': f'evil.example:{served.port}'}, **kw)
    assert r.status_code == 421, r.text
    message = r.json()['message'] if path == '/api' else r.json()['error']['message']
    assert message == ("the Host header 'evil.example:%d' is not a name this server answers to (127.0.0.1, ::1, "
                       'example.test, localhost); start it with --allowed-host to add one' % served.port)
    for host in (f'example.test:{served.port}', f'localhost:{served.port}', f'[::1]:{served.port}', 'EXAMPLE.test'):
        assert httpx.request(method, served.url + path, headers={**AUTH, 'host': host}, **kw).status_code == 200, host


def test_allowed_host_star_answers_any_host(gen):
    with Server(gen, Limits(**LIMITS), access=Access(hosts=('*',))) as u:
        assert httpx.get(u + '/health', headers={'host': 'evil.example'}).status_code == 200
    with Server(gen, Limits(**LIMITS), access=Access(hosts=('example.test',))) as u:
        assert httpx.get(u + '/health', headers={'host': 'evil.example'}).status_code == 421
        assert httpx.get(u + '/health', headers={'host': 'example.test'}).status_code == 200


@pytest.mark.parametrize('headers,said', [
    ({}, 'this server needs an API key: send the header "Authorization: Bearer KEY" with the key the server was '
         'started with (--api-key or GPTKIT_API_KEY)'),
    ({'authorization': 'Bearer s3cret-Kex'}, 'the API key in the Authorization header is wrong; send the key the server '
                                             'was started with (--api-key or GPTKIT_API_KEY)'),
    ({'authorization': KEY}, 'the Authorization header must be "Bearer KEY" with the key the server was started with '
                             '(--api-key or GPTKIT_API_KEY)'),
])
def test_a_missing_or_wrong_api_key_is_refused_in_each_apis_shape(served, headers, said):
    r = httpx.post(served.url + '/v1/completions', headers=headers, json={'prompt': 'And', 'max_tokens': 2})
    assert (r.status_code, r.json()) == (401, {'error': {'message': said, 'type': 'invalid_request_error', 'param': None,
                                                         'code': 'invalid_api_key'}})
    assert r.headers['www-authenticate'] == 'Bearer'
    r = httpx.put(served.url + '/api', headers=headers, json={'prompts': ['And'], 'tokens_to_generate': 2})
    assert (r.status_code, r.json()) == (401, {'message': said})
    assert httpx.get(served.url + '/v1/models', headers=headers).status_code == 401
    assert httpx.get(served.url + '/health', headers=headers).status_code == 200       # open, as in vLLM


def test_the_right_key_works_with_the_openai_client_and_megatrons_api(served, gen):
    from openai import AuthenticationError, OpenAI
    client = OpenAI(base_url=served.url + '/v1', api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    c = client.completions.create(model=NAME, prompt='And God said', max_tokens=8, temperature=0)
    assert c.choices[0].text == greedy(gen, 'And God said', 8).text
    with pytest.raises(AuthenticationError, match='the API key in the Authorization header is wrong'):
        OpenAI(base_url=served.url + '/v1', api_key='wrong', max_retries=0).models.list()
    r = httpx.put(served.url + '/api', headers=AUTH, json={'prompts': ['And God said'], 'tokens_to_generate': 8, 'top_k': 1})
    assert r.status_code == 200 and r.json()['text'][0] == 'And God said' + greedy(gen, 'And God said', 8).text


def test_the_client_sends_the_key_and_prints_the_servers_text_as_text(served, gen):
    "gptkit client takes --api-key/GPTKIT_API_KEY; a model name or an error holding rich markup is printed as written"
    env = {k: v for k, v in os.environ.items() if k != 'GPTKIT_API_KEY'}
    client = [sys.executable, '-m', 'gptkit_cli.main', 'client', served.url, '--max-tokens', '8', '--temperature', '0']
    r = subprocess.run(client, input='And God said\n\n', capture_output=True, text=True, timeout=60,
                       env={**env, 'GPTKIT_API_KEY': KEY, 'COLUMNS': '300'})
    assert r.returncode == 0 and NAME in r.stderr and greedy(gen, 'And God said', 8).text in r.stdout, r.stderr
    r = subprocess.run(client + ['--api-key', 'wrong'], input='', capture_output=True, text=True, timeout=60,
                       env={**env, 'COLUMNS': '300'})
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr
    assert f'error: {served.url} refused the request: the API key in the Authorization header is wrong' in r.stderr


def test_clients_that_leave_mid_body_leave_no_traceback(served):
    for method, path in [('POST', '/v1/completions'), ('PUT', '/api'), ('POST', '/v1/chat/completions')] * 3:
        s = send_raw(served.port, f'{method} {path} HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n'
                                  'Content-Type: application/json\nContent-Length: 1000', b'{"prompt": "And')
        time.sleep(0.05)
        s.close()
    time.sleep(0.5)
    assert httpx.get(served.url + '/health').json()['status'] == 'ok'
    no_traceback(served.log())


def test_sigterm_with_requests_still_arriving_stops_at_once_without_a_traceback(served):
    "Runs last: it stops the module's server. Requests still sending their bodies are answered 503, not held 30 s"
    held = [send_raw(served.port, f'{m} {p} HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n'
                                  'Content-Type: application/json\nContent-Length: 1000', b'{"prompt')
            for m, p in [('POST', '/v1/completions'), ('PUT', '/api'), ('POST', '/v1/completions')]]
    time.sleep(0.3)
    t0 = time.perf_counter()
    served.proc.send_signal(signal.SIGTERM)
    answers = [read_answer(s, timeout=10) for s in held]
    served.proc.wait(timeout=15)
    took = time.perf_counter() - t0
    for s in held: s.close()
    # uvicorn stops gracefully, then raises SIGTERM again, so the process reports it ended by SIGTERM (as before)
    assert served.proc.returncode == -signal.SIGTERM and took < 10, (served.proc.returncode, took)
    assert answers[1] == (503, {'message': 'the server is shutting down; send the request again later'})
    assert answers[0][0] == 503 and answers[0][1]['error']['message'] == answers[1][1]['message']
    log = served.log()
    no_traceback(log)
    assert 'Finished server process' in log


def test_requests_still_running_after_the_grace_period_end_without_a_traceback(gen, capfd, caplog):
    "Stopping waits `grace` seconds for running requests, then ends them: 503 if nothing was sent yet, else the stream"
    import threading
    slow, got = SlowGenerator(gen), {}
    server = Server(slow, Limits(max_new_tokens=48, max_prompts=16), grace=0.5)
    u = server.__enter__()
    def plain():
        got['plain'] = httpx.post(u + '/v1/completions', json={'prompt': 'And', 'max_tokens': 48, 'n': 16}, timeout=60)
    def stream():
        with httpx.stream('POST', u + '/v1/completions', timeout=60,
                          json={'prompt': 'And', 'max_tokens': 48, 'stream': True}) as r:
            got['stream'] = list(r.iter_lines())
    threads = [threading.Thread(target=f) for f in (plain, stream)]
    for t in threads: t.start()
    while slow.rows < 34: time.sleep(0.01)                    # both run: 17 rows a token, 48 tokens take ~8 s
    t0 = time.perf_counter()
    server.__exit__(None, None, None)
    for t in threads: t.join(30)
    assert time.perf_counter() - t0 < 5
    assert (got['plain'].status_code, got['plain'].json()['error']['message']) == (503, 'the server stopped before this '
                                                                                        'request finished')
    events = [e for e in got['stream'] if e.startswith('data: ')]
    assert events and 'data: [DONE]' not in events                 # cut short, but a well-formed stream
    assert 'Traceback' not in capfd.readouterr().err
    assert [r.getMessage() for r in caplog.records if r.name == 'gptkit.serve.guard'] == [
        'POST /v1/completions was still running when the server stopped'] * 2


def test_cli_refuses_bad_addresses_keys_and_hosts_in_one_sentence(tiny_checkpoint):
    ckpt = ['serve', '--checkpoint', tiny_checkpoint]
    r = run_here(*ckpt, '--host', '999.1.1.1')
    assert r.returncode == 2 and "error: --host '999.1.1.1' is not an address or a name of this machine" in r.stderr, r
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_here(*ckpt, '--port', port)
        assert r.returncode == 1 and f"cannot listen on '127.0.0.1' port {port} (Address already in use)" in r.stderr, r
    r = run_here(*ckpt, '--api-key', ' ')
    assert r.returncode == 2 and '--api-key (or GPTKIT_API_KEY) is empty' in r.stderr, r
    r = run_here(*ckpt, '--allowed-host', 'http://example.test/')
    assert r.returncode == 2 and "--allowed-host 'http://example.test/' must be a host name or address" in r.stderr, r


# A chat template is a file that comes with a checkpoint, and the server renders it for whoever sends a conversation.
# These are the templates that froze the whole server (10^10 loop turns) or asked for 3 GB and a terabyte per request.
HOSTILE = {
    'loops': '{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}',
    'times': "{{ 'x' * 3000000000 }}",
    'doubling': "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                '{{ ns.s }}',
}
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
# one server serves every case: each hostile part runs only when the last message's text names it
TRAPPED = ("{% set c = messages[-1]['content'] %}{% if c == 'loops' %}" + HOSTILE['loops'] +
           "{% elif c == 'times' %}" + HOSTILE['times'] + "{% elif c == 'doubling' %}" + HOSTILE['doubling'] +
           '{% endif %}' + PLAIN_TEMPLATE)


def with_template(tiny_checkpoint, folder, template: str):
    "A copy of the tiny checkpoint whose tokenizer folders hold `template` in tokenizer_config.json, and that file"
    run = folder / 'run'
    shutil.copytree(tiny_checkpoint, run, symlinks=True)
    from gptkit.store.folders import manifest, state_text
    for tok in [p for p in run.rglob('tokenizer') if p.is_dir()]:
        config = tok / 'tokenizer_config.json'
        saved = json.loads(config.read_text()) if config.is_file() else {}
        config.write_text(json.dumps({**saved, 'chat_template': template}))
    served = [p for p in run.rglob('iter_*/tokenizer/tokenizer_config.json')]
    assert len(served) == 1, served
    checkpoint = served[0].parent.parent             # sealed again, as a checkpoint shipped with this template would be
    state = json.loads((checkpoint / 'state.json').read_text())
    (checkpoint / 'state.json').write_text(state_text({**state, 'files': manifest(checkpoint)}))
    return run, served[0]


@pytest.fixture(scope='module')
def trapped(tiny_checkpoint, tmp_path_factory):
    "A `gptkit serve` process whose chat template misbehaves on the messages 'loops', 'times' and 'doubling'"
    folder = tmp_path_factory.mktemp('trapped')
    run, config = with_template(tiny_checkpoint, folder, TRAPPED)
    for s in serving(run, folder / 'serve.log'):
        s.config = config
        yield s


def chat(url: str, text: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + '/v1/chat/completions', json={'messages': [{'role': 'user', 'content': text}],
                                                          'max_tokens': 2, 'temperature': 0}, timeout=timeout)


@pytest.mark.parametrize('what,said', [
    ('loops', r'took over 2 s to render these messages; it is refused'),
    ('times', r'needed more than [\d,]+ bytes to render these messages; it is refused'),
    ('doubling', r'needed more than [\d,]+ bytes to render these messages; it is refused'),
], ids=['loops', 'times', 'doubling'])
def test_a_chat_template_that_would_stall_or_exhaust_the_server_is_refused_while_it_answers(trapped, tiny_data, what,
                                                                                          said):
    """The request is answered 400 in seconds with one sentence naming the file, /health answers all the while (< 1 s),
    and the server goes on serving chat with the same template"""
    got = {}
    asked = threading.Thread(target=lambda: got.update(r=chat(trapped.url, what)))
    t0 = time.monotonic()
    asked.start()
    health = []
    while asked.is_alive():
        t = time.monotonic()
        r = httpx.get(trapped.url + '/health', timeout=5)
        health.append((r.status_code, round(time.monotonic() - t, 3)))
        time.sleep(0.05)
    took = time.monotonic() - t0
    r = got['r']
    assert r.status_code == 400 and took < 10, (r.status_code, r.text, took)
    error = r.json()['error']
    assert error['param'] == 'messages' and error['type'] == 'invalid_request_error', error
    assert re.fullmatch(re.escape(f'the chat template in {trapped.config} ') + said, error['message']), error['message']
    assert health and all(code == 200 and s < 1 for code, s in health), health
    from gptkit.tokenizer.bpe import load_tokenizer
    r = chat(trapped.url, 'And God said')                             # the same template, a fresh render process
    assert r.status_code == 200, r.text
    prompt = load_tokenizer(tiny_data[1]).encode('user: And God said\nassistant:')
    assert r.json()['usage']['prompt_tokens'] == len(prompt) and r.json()['choices'][0]['message']['role'] == 'assistant'
    assert trapped.proc.poll() is None
    no_traceback(trapped.log())


def run_within(seconds: float, *args):
    "`run_here(*args)` on a thread: the test fails if it has not returned within `seconds` (a server that started)"
    got = {}
    thread = threading.Thread(target=lambda: got.update(r=run_here(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f'gptkit {" ".join(map(str, args))} still runs after {seconds} s: it serves')
    return got['r']


def test_serve_refuses_to_start_with_a_chat_template_that_loops_for_ages(tiny_checkpoint, tmp_path):
    "The campaign's template, as a user meets it: the process ends with 1 and one sentence naming the file"
    run, config = with_template(tiny_checkpoint, tmp_path, HOSTILE['loops'])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, '-m', 'gptkit_cli.main', 'serve', '--checkpoint', str(run), '--port',
                        str(_free_port())], capture_output=True, text=True, timeout=60, env=serve_env())
    assert r.returncode == 1 and time.monotonic() - t0 < 30, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip() == (f'error: the chat template in {config} took over 2 s to render a sample conversation; '
                                'it is refused'), r.stderr
    assert 'web page' not in r.stdout, r.stdout                  # refused before it says where it would serve
    no_traceback(r.stdout + r.stderr)


# the templates refused for their size get 5 s, so that a loaded machine cannot make time the reason instead
@pytest.mark.parametrize('template,seconds,said', [
    (HOSTILE['loops'], '0.5', r'took over 0\.5 s to render a sample conversation; it is refused'),
    (HOSTILE['times'], '5', r'needed more than [\d,]+ bytes to render a sample conversation; it is refused'),
    (HOSTILE['doubling'], '5', r'needed more than [\d,]+ bytes to render a sample conversation; it is refused'),
    ('{% for m in messages %}', '0.5', r'is not a Jinja template: line 1: Unexpected end of template\..*'),
], ids=['loops', 'times', 'doubling', 'unfinished'])
def test_serve_refuses_to_start_with_a_chat_template_that_fails_on_a_sample_conversation(tiny_checkpoint, tmp_path,
                                                                                         template, seconds, said):
    run, config = with_template(tiny_checkpoint, tmp_path, template)
    r = run_within(30, 'serve', '--checkpoint', run, '--port', _free_port(), '--template-seconds', seconds)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[1:] == ['SystemExit(1)'], r.stderr                # run_here adds how the command ended
    assert re.fullmatch(re.escape(f'error: the chat template in {config} ') + said, lines[0]), lines[0]
    assert 'web page' not in r.stdout, r.stdout
    no_traceback(r.stdout + r.stderr)
