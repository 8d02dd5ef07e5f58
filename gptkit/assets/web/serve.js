// The web page of gptkit serve (a file of its own: the page's Content-Security-Policy forbids inline script).
// A model with a chat template is chatted with (/v1/chat/completions, the whole conversation each time); any other
// model's prompt is continued (/v1/completions). Model and user text is only ever set as textContent.
const $ = (id) => document.getElementById(id);
const chatting = document.body.dataset.chat === 'template';
let controller = null;
let history = [];             // the conversation so far: {role, content}, as /v1/chat/completions reads it
let conversation = 0;         // counts the conversations started, so a reply stopped by a new one is let go

function setRunning(running) {
  $('generate').disabled = running;
  $('send').disabled = running;
  $('stop').disabled = !running;
}

function headers() {
  const h = {'Content-Type': 'application/json'};
  if ($('api_key').value) h['Authorization'] = 'Bearer ' + $('api_key').value;
  return h;
}

function sampling() {
  return {stream: true, temperature: Number($('temperature').value), top_p: Number($('top_p').value),
          top_k: Number($('top_k').value)};
}

// POST `body` to `path` and call `onChoice` with each streamed event's first choice; the finish reason and the
// number of events come back. A refusal or an error event throws with the server's sentence.
async function stream(path, body, onChoice) {
  const res = await fetch(path, {method: 'POST', headers: headers(), body: JSON.stringify(body),
                                 signal: controller.signal});
  if (!res.ok) {
    const err = await res.json().catch(() => ({}));
    throw new Error((err.error && err.error.message) || `HTTP ${res.status}`);
  }
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '', pieces = 0, finish = null;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith('data: ')) continue;
      const data = event.slice(6);
      if (data === '[DONE]') continue;
      const msg = JSON.parse(data);
      if (msg.error) throw new Error(msg.error.message);
      if (!msg.choices || !msg.choices.length) continue;
      const choice = msg.choices[0];
      onChoice(choice);
      pieces += 1;
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  return {finish, pieces};
}

// Run one request: the status line says what happened (data-finish: the finish reason, 'stopped' or 'error').
// `onEnd(how)` runs once it is over ('done', 'stopped' or 'error'), before the status is set.
async function run(path, body, onChoice, onEnd) {
  const status = $('status');
  status.className = '';
  status.textContent = 'generating...';
  delete status.dataset.finish;
  controller = new AbortController();
  setRunning(true);
  const start = performance.now();
  try {
    const {finish, pieces} = await stream(path, body, onChoice);
    onEnd('done');
    const secs = (performance.now() - start) / 1000;
    status.textContent = `done (${finish}): ${pieces} events in ${secs.toFixed(2)} s`;
    status.dataset.finish = finish;
  } catch (e) {
    const stopped = e.name === 'AbortError';
    onEnd(stopped ? 'stopped' : 'error');
    if (stopped) {
      status.textContent = 'stopped';
      status.dataset.finish = 'stopped';
    } else {
      status.className = 'error';
      status.textContent = 'error: ' + e.message;
      status.dataset.finish = 'error';
    }
  } finally {
    setRunning(false);
    controller = null;
  }
}

async function generate() {
  const out = $('output');
  out.textContent = '';
  const prompt = document.createElement('span');
  prompt.className = 'prompt';
  prompt.textContent = $('prompt').value;
  const text = document.createElement('span');
  text.id = 'completion';
  out.append(prompt, text);
  const body = {...sampling(), prompt: $('prompt').value, max_tokens: Number($('max_tokens').value)};
  await run('/v1/completions', body, (choice) => { text.textContent += choice.text; }, () => {});
}

function turn(role, content) {
  const div = document.createElement('div');
  div.className = 'turn ' + role;
  div.dataset.role = role;
  div.textContent = content;
  $('turns').append(div);
  return div;
}

// Send the message typed as the user's next turn, with the whole conversation, and stream the reply into a turn of
// its own. A reply stopped keeps what came; one that fails, or is stopped before any text, leaves the conversation
// as it was, with the message back in the box to send again.
async function send() {
  const box = $('message');
  const mine = conversation;
  const content = box.value;
  if (!content.trim() || controller) return;
  box.value = '';
  const asked = turn('user', content);
  const reply = turn('assistant', '');
  history.push({role: 'user', content});
  const body = {...sampling(), messages: history.slice(), max_completion_tokens: Number($('max_tokens').value)};
  const onChoice = (choice) => { reply.textContent += (choice.delta && choice.delta.content) || ''; };
  await run('/v1/chat/completions', body, onChoice, (how) => {
    if (mine !== conversation) return;
    if (how === 'done' || (how === 'stopped' && reply.textContent)) {
      history.push({role: 'assistant', content: reply.textContent});
      return;
    }
    history.pop();
    asked.remove();
    reply.remove();
    box.value = content;
  });
}

function newConversation() {
  if (controller) controller.abort();
  conversation += 1;
  history = [];
  $('turns').textContent = '';
  $('status').textContent = '';
  $('message').focus();
}

$('key').hidden = document.body.dataset.apiKey !== 'required';
$('stop').addEventListener('click', () => controller && controller.abort());
if (chatting) {
  $('endpoint').textContent = '/v1/chat/completions';
  $('completion_mode').hidden = true;
  $('output').hidden = true;
  $('generate').hidden = true;
  $('chat_mode').hidden = false;
  $('send').hidden = false;
  $('new').hidden = false;
  $('send').addEventListener('click', send);
  $('new').addEventListener('click', newConversation);
  $('message').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
} else {
  $('generate').addEventListener('click', generate);
  $('prompt').addEventListener('keydown', (e) => { if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) generate(); });
}
