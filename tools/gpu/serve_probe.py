"""Ask a running `gptkit serve` for greedy completions: one request alone, then 8 at once; tokens/s of each.
Run: python tools/gpu/serve_probe.py http://127.0.0.1:5077 (it waits up to 120 s for /health)"""
import json
import sys
import threading
import time
import urllib.request


def ask(url: str, tokens: int, out: list):
    body = json.dumps({'prompt': 'And God said', 'max_tokens': tokens, 'temperature': 0}).encode()
    request = urllib.request.Request(url + '/v1/completions', body, {'Content-Type': 'application/json'})
    start = time.perf_counter()
    answer = json.load(urllib.request.urlopen(request, timeout=120))
    out.append((time.perf_counter() - start, answer['usage']['completion_tokens']))


def wait(url: str, seconds: int = 120):
    for _ in range(seconds):
        try:
            return urllib.request.urlopen(url + '/health', timeout=2)
        except OSError:
            time.sleep(1)
    raise SystemExit(f'{url} did not answer /health in {seconds} s')


def main(url: str):
    wait(url)
    ask(url, 8, [])                              # warm-up
    one = []
    ask(url, 128, one)
    print(f'serve, 1 request: {one[0][1]} tokens in {one[0][0]:.3f} s, {one[0][1] / one[0][0]:,.0f} tokens/s')
    many = []
    threads = [threading.Thread(target=ask, args=(url, 128, many)) for _ in range(8)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, made = time.perf_counter() - start, sum(m[1] for m in many)
    print(f'serve, 8 requests at once: {made} tokens in {wall:.3f} s, {made / wall:,.0f} tokens/s')


if __name__ == '__main__':
    main(sys.argv[1])
