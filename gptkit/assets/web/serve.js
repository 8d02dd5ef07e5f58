// The web page of gptkit serve (a file of its own: the page's Content-Security-Policy forbids inline script).
const $ = (id) => document.getElementById(id);
let controller = null;

function setRunning(running) {
  $('generate').disabled = running;
  $('stop').disabled = !running;
}

async function generate() {
  const out = $('output'), status = $('status');
  out.textContent = '';
  const prompt = document.createElement('span');
  prompt.className = 'prompt';
  prompt.textContent = $('prompt').value;
  const text = document.createElement('span');
  text.id = 'completion';
  out.append(prompt, text);
  status.className = ''; status.textContent = 'generating...';
  const headers = {'Content-Type': 'application/json'};
  if ($('api_key').value) headers['Authorization'] = 'Bearer ' + $('api_key').value;
  const body = {
    prompt: $('prompt').value, stream: true,
    max_tokens: Number($('max_tokens').value), temperature: Number($('temperature').value),
    top_p: Number($('top_p').value), top_k: Number($('top_k').value),
  };
  controller = new AbortController();
  setRunning(true);
  const start = performance.now();
  let pieces = 0, finish = null;
  try {
    const res = await fetch('/v1/completions', {
      method: 'POST', headers: headers,
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${res.status}`);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        if (!event.startsWith('data: ')) continue;
        const data = event.slice(6);
        if (data === '[DONE]') continue;
        const msg = JSON.parse(data);
        if (msg.error) throw new Error(msg.error.message);
        const choice = msg.choices[0];
        text.textContent += choice.text;
        pieces += 1;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    const secs = (performance.now() - start) / 1000;
    status.textContent = `done (${finish}): ${pieces} events in ${secs.toFixed(2)} s`;
    status.dataset.finish = finish;
  } catch (e) {
    if (e.name === 'AbortError') { status.textContent = 'stopped'; status.dataset.finish = 'stopped'; }
    else { status.className = 'error'; status.textContent = 'error: ' + e.message; status.dataset.finish = 'error'; }
  } finally {
    setRunning(false);
    controller = null;
  }
}

$('key').hidden = document.body.dataset.apiKey !== 'required';
$('generate').addEventListener('click', generate);
$('stop').addEventListener('click', () => controller && controller.abort());
$('prompt').addEventListener('keydown', (e) => { if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) generate(); });
