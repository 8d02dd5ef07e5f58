"""Write gptkit's built-in conversation set (builtin:conversations) and its held-out questions, deterministically.

    python tools/make_conversations.py            # writes gptkit/assets/corpora/conversations.jsonl.gz
                                                  #    and gptkit/assets/corpora/conversations_heldout.jsonl

Every conversation was written by this script for gptkit (nothing is downloaded): short exchanges that teach skills a
tiny model can pick up in a few hundred CPU steps: adding two small numbers, comparing two numbers, repeating,
reversing and upper-casing a word; each asked in several phrasings, some after a system message, some over several
turns. The reply is the answer alone, so an evaluation can compare it exactly.

The held-out file holds questions whose (skill, operands) never occur in the training set (they are drawn first and
kept out of it), one JSON object per line:
{"skill": ..., "question": ..., "answer": ...}, which an lm-eval task reads as it is. Running the script again writes
the same bytes (fixed seed, gzip without a timestamp)."""
from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / 'gptkit' / 'assets' / 'corpora'
TRAIN, HELD_OUT = 'conversations.jsonl.gz', 'conversations_heldout.jsonl'
SEED, CONVERSATIONS, QUESTIONS = 34, 3000, 200

WORDS = ('apple', 'river', 'stone', 'cloud', 'green', 'table', 'house', 'music', 'light', 'bread', 'horse', 'water',
         'paper', 'chair', 'smile', 'plant', 'night', 'train', 'sugar', 'tiger', 'lemon', 'ocean', 'pilot', 'queen',
         'robot', 'snake', 'tower', 'voice', 'wheel', 'zebra', 'bird', 'book', 'cake', 'door', 'fish', 'gold', 'hand',
         'kite', 'lamp', 'moon', 'nest', 'rain', 'ship', 'star', 'tree', 'wind', 'yarn', 'bell', 'coin', 'drum',
         'frog', 'goat', 'hill', 'iron', 'jump', 'king', 'leaf', 'milk', 'nose', 'pear', 'road', 'salt', 'sand',
         'snow', 'sock', 'tent', 'vase', 'wolf', 'cat', 'dog', 'sun', 'cup', 'hat', 'pen', 'map', 'egg', 'box', 'bus',
         'red', 'sky', 'owl', 'ant', 'bee', 'fox', 'jam', 'key', 'ink', 'oak', 'tea', 'toy', 'garden', 'planet',
         'window', 'winter', 'summer', 'silver', 'orange', 'purple', 'rocket', 'bottle', 'candle', 'forest', 'island',
         'number', 'letter', 'pencil', 'rabbit', 'spider', 'turtle', 'yellow', 'basket', 'button', 'dragon', 'flower')
TIMES = {2: 'twice', 3: 'three times', 4: 'four times'}
SYSTEMS = ('You are a helpful assistant.', 'Answer with the result only.',
           'You are a careful assistant. Reply briefly.', 'You answer small questions about numbers and words.')


def add(rng):
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    q = rng.choice(('What is {a} plus {b}?', 'Add {a} and {b}.', '{a} + {b} = ?', 'Compute {a} + {b}.',
                    'What do you get when you add {a} and {b}?', 'What is the sum of {a} and {b}?'))
    return ('add', a, b), q.format(a=a, b=b), str(a + b)


def compare(rng):
    a, b = rng.sample(range(0, 100), 2)
    kind = rng.randrange(3)
    if kind == 0:
        q = rng.choice(('Which is larger, {a} or {b}?', 'Which number is bigger: {a} or {b}?',
                        'What is the larger of {a} and {b}?'))
        return ('max', a, b), q.format(a=a, b=b), str(max(a, b))
    if kind == 1:
        q = rng.choice(('Which is smaller, {a} or {b}?', 'Which number is less: {a} or {b}?',
                        'What is the smaller of {a} and {b}?'))
        return ('min', a, b), q.format(a=a, b=b), str(min(a, b))
    q = rng.choice(('Is {a} greater than {b}?', 'Is {a} more than {b}? Answer yes or no.'))
    return ('greater', a, b), q.format(a=a, b=b), 'yes' if a > b else 'no'


def repeat(rng):
    w, n = rng.choice(WORDS), rng.choice(tuple(TIMES))
    q = rng.choice(('Repeat the word {w} {t}.', 'Say {w} {t}.', 'Write {w} {t}, with spaces between.'))
    return ('repeat', w, n), q.format(w=w, t=TIMES[n]), ' '.join([w] * n)


def reverse(rng):
    w = rng.choice(WORDS)
    q = rng.choice(('Spell {w} backwards.', 'Reverse the word {w}.', 'Write the letters of {w} in reverse order.'))
    return ('reverse', w), q.format(w=w), w[::-1]


def upper(rng):
    w = rng.choice(WORDS)
    q = rng.choice(('Write {w} in capital letters.', 'Uppercase this word: {w}', 'Say {w} in upper case.'))
    return ('upper', w), q.format(w=w), w.upper()


SKILLS = (add, compare, repeat, reverse, upper)


def conversation(rng, held: set) -> list[dict]:
    "One conversation: an optional system message, then one to three questions, none of them `held` out, answered"
    messages = []
    if rng.random() < 0.3:
        messages.append({'role': 'system', 'content': rng.choice(SYSTEMS)})
    turns = rng.choices((1, 2, 3), weights=(8, 3, 1))[0]
    asked = 0
    while asked < turns:
        key, question, answer = rng.choice(SKILLS)(rng)
        if key not in held:
            messages += [{'role': 'user', 'content': question}, {'role': 'assistant', 'content': answer}]
            asked += 1
    return messages


def build() -> tuple[bytes, bytes]:
    "The gzip-compressed training set and the held-out questions, as bytes"
    rng = random.Random(SEED)
    held, asked = [], set()
    while len(held) < QUESTIONS:                         # drawn first, then kept out of the training set
        skill = SKILLS[len(held) % len(SKILLS)]          # the same number of questions for each skill
        key, question, answer = skill(rng)
        if key not in asked:
            asked.add(key)
            held.append(json.dumps({'skill': skill.__name__, 'question': question, 'answer': answer}))
    rows = [json.dumps({'messages': conversation(rng, asked)}, ensure_ascii=False) for _ in range(CONVERSATIONS)]
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode='wb', compresslevel=9, mtime=0, filename='') as f:
        f.write(('\n'.join(rows) + '\n').encode('utf-8'))
    return buf.getvalue(), ('\n'.join(held) + '\n').encode('utf-8')


def main():
    train, held = build()
    (OUT / TRAIN).write_bytes(train)
    (OUT / HELD_OUT).write_bytes(held)
    print(f'{OUT / TRAIN}: {CONVERSATIONS:,} conversations, {len(train):,} bytes')
    print(f'{OUT / HELD_OUT}: {QUESTIONS:,} questions, {len(held):,} bytes')


if __name__ == '__main__':
    main()
