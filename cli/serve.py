"""`gptkit serve` (Megatron's and OpenAI's APIs over HTTP) and `gptkit client` (an interactive prompt against a
server)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gptkit.errors import ConfigError, GptkitError
from gptkit_cli.app import app, err, handles_errors, out
from gptkit_cli.launch import join_tp, launch_tp

Opt = typer.Option


def _quoted(text: str) -> str:
    "`text` quoted and cut to 60 characters, with the braces of a message template doubled"
    said = repr(text) if len(text) <= 60 else repr(text[:60]) + '...'
    return said.replace('{', '{{').replace('}', '}}')


@app.command()
@handles_errors
def serve(
    ctx: typer.Context,
    checkpoint: Annotated[Path, Opt(help='A run folder, its checkpoints/ folder or one iter_XXXXXXX folder.')],
    host: Annotated[str, Opt(help='Address to listen on (0.0.0.0 for every interface).')] = '127.0.0.1',
    port: Annotated[int, Opt(help='TCP port.')] = 5000,
    max_new_tokens: Annotated[int, Opt(help='Most new tokens a request may ask for.')] = 1024,
    max_prompt_tokens: Annotated[Optional[int], Opt(
        help="Longest prompt in tokens (default: the model's context less one).")] = None,
    max_prompts: Annotated[int, Opt(help='Most sequences (prompts x samples) per request.')] = 128,
    max_waiting: Annotated[int, Opt(help='Requests that may wait before the server answers 503.')] = 64,
    max_batch: Annotated[int, Opt(help='Most sequences generated at once, all requests together; a request joins '
                                       'the running batch at the next token when its sequences fit.')] = 128,
    name: Annotated[Optional[str], Opt(help='Model name in /v1/models (default: the run folder name).')] = None,
    device: Annotated[Optional[str], Opt(help='cpu or cuda (default: cuda when there is a GPU).')] = None,
    dtype: Annotated[str, Opt(help='fp32, bf16, or auto: on a CPU the one measured faster for this model\'s '
                                   'shapes (bf16 where 1.3x or more); on a GPU bf16 (fp16 without '
                                   'it).')] = 'auto',
    tp: Annotated[int, Opt(help='Shard the model over this many processes on this machine, as training splits it '
                                '(torchrun; gloo on CPU, NCCL on GPU); the first serves.')] = 1,
    api_key: Annotated[Optional[str], Opt(envvar='GPTKIT_API_KEY', show_default=False, help=(
        'Require this key on /api and /v1 ("Authorization: Bearer KEY", as OpenAI clients send their api_key); '
        '/health and the web page stay open, and the page asks for the key. Prefer the environment variable: other '
        "users see a command line in ps."))] = None,
    allowed_host: Annotated[Optional[list[str]], Opt(metavar='<host>', help=(
        'Also answer requests whose Host header names this (repeatable; * for any). Loopback names and --host are '
        'always answered; others are refused, which stops DNS rebinding.'))] = None,
    template_seconds: Annotated[float, Opt(help=(
        "Most seconds the checkpoint's chat template may take to render one conversation; it runs in a process of its "
        'own, which is stopped after this and the request refused.'))] = 2.0,
    request_seconds: Annotated[float, Opt(help='Most seconds one request may run once started; then it stops, and '
                                               'its client is told (HTTP 504; a stream: an error event).')] = 600.0,
):
    ("""Serve a checkpoint: Megatron's PUT /api, OpenAI's /v1/completions, /v1/chat/completions (both streaming) """
     """and /v1/models, /health, and a web page at /.""")
    bad = _problems(port, tp, (template_seconds, request_seconds), api_key, allowed_host or [], max_batch=max_batch,
                    max_new_tokens=max_new_tokens, max_prompts=max_prompts, max_waiting=max_waiting,
                    max_prompt_tokens=max_prompt_tokens or 1)
    if bad:
        raise ConfigError(bad)
    from gptkit.inference.batching import Limits
    from gptkit.serve.guard import Access
    from gptkit.serve.server import check_address, load_serving, serve
    check_address(host, 0)              # --host resolves and is this machine's, before a model loads; the port below
    if tp > 1 and 'RANK' not in os.environ:
        raise typer.Exit(launch_tp(ctx, 'serve', tp))
    device = join_tp(device)[1] if tp > 1 else device
    limits = Limits(max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, max_prompts=max_prompts,
                    max_waiting=max_waiting, max_batch=max_batch, template_seconds=template_seconds,
                    request_seconds=request_seconds)
    with out.status(f'loading {escape(str(checkpoint))}'):   # a chat template that fails a sample stops it here
        serving = load_serving(checkpoint, host=host, port=port, device=device, dtype=dtype, tp=tp, limits=limits,
                               name=name, access=Access(tuple(allowed_host or ()), api_key))
    _banner(serving, keyed=api_key is not None)
    serve(serving)


def _problems(port: int, tp: int, seconds: tuple[float, float], api_key: str | None, allowed_host: list[str],
              **limits: int) -> list[tuple[str, str]]:
    "Every problem with `gptkit serve`'s options, as (option, sentence) pairs; `seconds`: the template's, a request's"
    bad = [(k, f'{{key}} must be at least 1, not {v}') for k, v in limits.items() if v < 1]
    if not 0 < port < 65536:
        bad.append(('port', f'{{key}} must be between 1 and 65535, not {port}'))
    if tp < 1:
        bad.append(('tp', f'{{key}} must be at least 1, not {tp}'))
    template_seconds, request_seconds = seconds
    if not 0 < template_seconds <= 600:
        bad.append(('template_seconds', f'{{key}} must be more than 0 and at most 600, not {template_seconds:g}'))
    if not request_seconds > 0:                                     # nan too
        bad.append(('request_seconds', f'{{key}} must be more than 0, not {request_seconds:g}'))
    if api_key is not None and not api_key.strip():
        bad.append(('api_key', '{key} (or GPTKIT_API_KEY) is empty; give a key or leave it out'))
    for h in allowed_host:
        if not h or any(c in h for c in '/ \t'):
            bad.append(('allowed_host', f'{{key}} {_quoted(h)} must be a host name or address like example.com, '
                                        'without a scheme or a path'))
    return bad


def _banner(serving, keyed: bool):
    "What the server serves, where, to which Host names (loopback ones first), and whether it needs a key"
    gen, host, port = serving.gen, serving.host, serving.port
    step = gen.loaded.state.get('iteration', '?')
    out.print(f'[bold]{escape(serving.name)}[/]: {escape(str(gen.loaded.folder))} (step {step}), context '
              f'{gen.context}, on {gen.model.wte.weight.device}')
    if gen.decode is not None:
        out.print(f'  [dim]{escape(gen.decode.why)}[/]')
    at = escape(f'http://{host}:{port}')
    out.print(f'  web page   {at}/\n  Megatron   PUT  {at}/api\n'
              f'  OpenAI     POST {at}/v1/completions, /v1/chat/completions  (base_url {at}/v1)\n'
              f'  schema     {at}/docs')
    hosts = serving.hosts
    said = 'any' if '*' in hosts else ', '.join(dict.fromkeys(hosts)) + ' (add others with --allowed-host)'
    out.print(f'  Host       {escape(said)}')
    key = 'required on /api and /v1' if keyed else 'none (anyone who reaches the server may use it; see --api-key)'
    out.print(f'  API key    {key}')


@app.command()
@handles_errors
def client(
    url: Annotated[str, typer.Argument(help='The server, like http://127.0.0.1:5000.')],
    max_tokens: Annotated[int, Opt(help='New tokens per answer.')] = 64,
    temperature: Annotated[float, Opt(help='0 for greedy.')] = 0.8,
    top_p: Annotated[float, Opt(help='Nucleus sampling.')] = 0.95,
    stop: Annotated[Optional[str], Opt(help='Stop before this text.')] = None,
    raw: Annotated[bool, Opt(help='Continue each prompt (/v1/completions), even for a model with a chat '
                                  'template.')] = False,
    api_key: Annotated[Optional[str], Opt(envvar='GPTKIT_API_KEY', show_default=False,
                                          help='The key of a server started with --api-key.')] = None,
):
    """An interactive prompt against a running gptkit server, streaming each answer. A model with a chat template (the
    server says so in /v1/models) is chatted with: the conversation is kept and sent whole each turn, and a line /new
    starts a new one; --raw continues each prompt instead, as any other model is served. A line ending with a
    backslash goes on on the next line; an empty line or Ctrl-D quits, Ctrl-C stops an answer."""
    url = url.rstrip('/')
    if not url.startswith(('http://', 'https://')):
        url = 'http://' + url
    headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
    model, templated = _served(url, headers)
    chatting = templated and not raw
    how = 'chat: /new starts a new conversation' if chatting else 'completions'
    err.print(f'[dim]{escape(url)}, model {escape(str(model))} ({how}). Type a prompt and press Enter; end a line '
              'with \\ to go on on the next; an empty line or Ctrl-D quits.[/]')
    sampling = {'model': model, 'temperature': temperature, 'top_p': top_p, 'stream': True,
                **({'stop': stop} if stop else {})}
    history = []
    for text in _typed_texts():
        if not chatting:
            _stream(f'{url}/v1/completions', {**sampling, 'prompt': text, 'max_tokens': max_tokens}, headers)
            continue
        if text.strip() == '/new':
            history = []
            err.print('[dim](a new conversation)[/]')
            continue
        turns = history + [{'role': 'user', 'content': text}]
        body = {**sampling, 'messages': turns, 'max_completion_tokens': max_tokens}
        reply = _stream(f'{url}/v1/chat/completions', body, headers)
        if reply is not None:                # a reply that failed leaves the conversation as it was
            history = turns + [{'role': 'assistant', 'content': reply}]


def _served(url: str, headers: dict) -> tuple[str, bool]:
    "The model a gptkit server at `url` serves, and whether it has a chat template, from its /v1/models"
    import httpx
    try:
        r = httpx.get(f'{url}/v1/models', headers=headers, timeout=10)
        if r.status_code != 200:
            raise GptkitError(f'{url} refused the request: {_said(r)}')
        listed = r.json()['data'][0]
        return listed['id'], listed.get('chat_template') is True
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise GptkitError(f'{url} does not answer as a gptkit server ({type(e).__name__}: {e})') from None


def _typed_texts():
    """Texts typed at a `> ` prompt, one at a time, until an empty line, Ctrl-D or Ctrl-C; a line ending with a
    backslash goes on on the next (at a `. ` prompt), the backslash left out"""
    while True:
        lines = []
        try:
            line = input('> ')
            while line.endswith('\\'):
                lines.append(line[:-1])
                line = input('. ')
        except (EOFError, KeyboardInterrupt):
            return
        text = '\n'.join(lines + [line])
        if not text.strip():
            return
        yield text


def _stream(url: str, body: dict, headers: dict) -> str | None:
    """POST `body` to `url`, an OpenAI completions or chat completions endpoint, printing the answer as it streams;
    the text it said (Ctrl-C stops it there), or None when the server refused or failed"""
    import httpx
    said = []
    try:
        with httpx.stream('POST', url, json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                r.read()
                err.print(f'[bold red]error:[/] {escape(_said(r))}')
                return None
            finish = None
            for line in r.iter_lines():
                if not line.startswith('data: ') or line == 'data: [DONE]':
                    continue
                msg = json.loads(line[6:])
                if 'error' in msg:
                    err.print(f'\n[bold red]error:[/] {escape(str(msg["error"]["message"]))}')
                    return None
                if not msg.get('choices'):
                    continue
                choice = msg['choices'][0]
                piece = (choice['delta'].get('content') or '') if 'delta' in choice else choice['text']
                said.append(piece)
                out.print(piece, end='', markup=False, highlight=False)
                finish = choice['finish_reason'] or finish
            out.print(f'\n[dim]({escape(str(finish))})[/]')
    except KeyboardInterrupt:
        out.print('\n[dim](stopped)[/]')
    except httpx.HTTPError as e:
        err.print(f'\n[bold red]error:[/] the connection to {escape(url)} failed: {escape(str(e))}')
        return None
    return ''.join(said)


def _said(r) -> str:
    "The sentence of a server's error answer (OpenAI's or Megatron's shape), or its status and the start of its text"
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get('error'), dict) and 'message' in body['error']:
        return str(body['error']['message'])
    if isinstance(body, dict) and 'message' in body:
        return str(body['message'])
    return f'HTTP {r.status_code} {r.text[:200]!r}'
