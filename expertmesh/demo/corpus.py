"""A generator of simple English for the demo model's training corpus.

Every sentence is made here from templates and word lists written for this project: short
stories, small facts about animals, colours, numbers and the calendar, and short dialogues.
The output depends only on the seed (one ``random.Random``, lists iterated in written order),
so ``python -m expertmesh.demo.corpus`` rewrites the committed ``corpus.txt`` byte for byte.

Documents are separated by one blank line and contain none themselves.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from expertmesh.demo import words as W

DOC_SEPARATOR = "\n\n"
DEFAULT_DOCS = 1200


class Hero:
    """A character of one story: name, kind and pronouns."""

    def __init__(self, rng: random.Random, avoid: str = "") -> None:
        name, self.female = rng.choice([n for n in W.NAMES if n[0] != avoid])
        self.name = name
        self.kind = rng.choice(W.GIRL_KINDS if self.female else W.BOY_KINDS)
        self.he = "she" if self.female else "he"
        self.his = "her" if self.female else "his"
        self.him = "her" if self.female else "him"


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def story(rng: random.Random) -> str:
    h = Hero(rng)
    f = Hero(rng, avoid=h.name)
    place = rng.choice(W.PLACES)
    thing = rng.choice(W.THINGS)
    adj = rng.choice(W.CHARACTER_ADJS)
    opening = rng.choice(
        [
            f"Once upon a time, there was {a(adj)} {h.kind} named {h.name}.",
            f"Once upon a time, {a(adj)} {h.kind} called {h.name} lived {place}.",
            f"One {rng.choice(W.TIMES)}, {a(adj)} {h.kind} named {h.name} woke up early.",
            f"There once was {a(adj)} {h.kind} named {h.name} who lived {place}.",
        ]
    )
    s = [opening]
    hobby = f"{cap(h.he)} loved to {rng.choice(W.HOBBIES)}."
    s.append(hobby if place in opening else rng.choice([hobby, f"{cap(h.he)} lived {place}."]))
    s.append(
        rng.choice(
            [
                f"One day, {h.name} found {a(rng.choice(W.THING_ADJS) + ' ' + thing)} {rng.choice(W.SPOTS)}.",
                f"One day, {h.name} wanted to {rng.choice(W.GOALS)}.",
                f"Every morning, {h.name} went for a walk with {h.his} friend {f.name} the {f.kind}.",
            ]
        )
    )
    problem, fix = rng.choice(W.PROBLEMS)
    s.append(problem.format(h=h.name, he=h.he, his=h.his, thing=thing))
    s.append(f"{h.name} felt {rng.choice(W.SAD_FEELINGS)}.")
    s.append(rng.choice(W.ASKS).format(h=h.name, f=f.name, fk=f.kind))
    s.append(rng.choice(W.ANSWERS).format(f=f.name, him=h.him))
    s.append(f"Together they {fix.format(thing=thing)}.")
    s.append(f"{h.name} was {rng.choice(W.HAPPY_FEELINGS)}.")
    s.append(
        rng.choice(
            [
                f"From that day on, {h.name} and {f.name} were best friends.",
                f"{h.name} learned that {rng.choice(W.MORALS)}.",
                f'"Thank you, {f.name}," said {h.name}. "You are a good friend."',
                f"That night, {h.name} went to sleep with a big smile.",
            ]
        )
    )
    if rng.random() < 0.3:
        s.append("The end.")
    return " ".join(s)


def animal_fact(rng: random.Random) -> str:
    name, plural, sound, home, food, can, size, part = rng.choice(W.ANIMALS)
    s = [
        rng.choice(
            [
                f"{cap(a(name))} is an animal.",
                f"This is a fact about {plural}.",
                f"Let us learn about {plural}.",
            ]
        ),
        f"{cap(plural)} live {home}.",
        rng.choice([f"They eat {food}.", f"{cap(a(name))} likes to eat {food}."]),
        f"{cap(a(name))} can {can}.",
    ]
    if sound:
        s.append(rng.choice([f"{cap(a(name))} says {sound}.", f"When {a(name)} talks, it says {sound}."]))
    s.append(rng.choice([f"{cap(a(name))} is {size}.", f"{cap(a(name))} has {part}."]))
    tail = s[1:]
    rng.shuffle(tail)
    return " ".join([s[0], *tail])


def colour_fact(rng: random.Random) -> str:
    picks = rng.sample(W.COLOURED, 3)
    s = [f"The {thing} is {colour}." for thing, colour in picks]
    thing, colour = picks[0]
    s.append(rng.choice([f"{cap(colour)} is a nice colour.", f"I like the colour {colour}."]))
    s.append(f"What colour is the {thing}? The {thing} is {colour}.")
    return " ".join(s)


def number_fact(rng: random.Random) -> str:
    s = []
    for _ in range(rng.randint(2, 4)):
        x, y = rng.randint(0, 10), rng.randint(0, 10)
        op = rng.choice(["plus", "and", "minus"])
        if op == "minus":
            x, y = max(x, y), min(x, y)
            s.append(f"{cap(W.NUMBERS[x])} minus {W.NUMBERS[y]} is {W.NUMBERS[x - y]}.")
        elif op == "and":
            s.append(f"{cap(W.NUMBERS[x])} and {W.NUMBERS[y]} make {W.NUMBERS[x + y]}.")
        else:
            s.append(f"{cap(W.NUMBERS[x])} plus {W.NUMBERS[y]} is {W.NUMBERS[x + y]}.")
    n = rng.randint(1, 9)
    s.append(f"After {W.NUMBERS[n]} comes {W.NUMBERS[n + 1]}.")
    return " ".join(s)


def calendar_fact(rng: random.Random) -> str:
    d, m, k = rng.randrange(7), rng.randrange(12), rng.randrange(4)
    days, months = W.DAYS, W.MONTHS
    season, weather = W.SEASONS[k]
    s = [
        f"After {days[d]} comes {days[(d + 1) % 7]}.",
        f"The month after {months[m]} is {months[(m + 1) % 12]}.",
        f"In {season}, it is often {weather}.",
        rng.choice(["A week has seven days.", "A year has twelve months.", "A year has four seasons."]),
    ]
    rng.shuffle(s)
    return " ".join(s)


def dialogue(rng: random.Random) -> str:
    h = Hero(rng)
    f = Hero(rng, avoid=h.name)
    kind = rng.randrange(3)
    if kind == 0:
        n, fruit = rng.randint(2, 9), rng.choice(W.FRUITS)
        lines = [
            f'{h.name} went to the shop. "Hello," said {f.name}. "What would you like?"',
            f'"I would like {W.NUMBERS[n]} {fruit}, please," said {h.name}.',
            f'"Here you are," said {f.name}. "That is {W.NUMBERS[n]} {fruit}."',
            f'"Thank you!" said {h.name}, and {h.he} went home.',
        ]
    elif kind == 1:
        name, _, sound, home, *_ = rng.choice([x for x in W.ANIMALS if x[2]])
        lines = [
            f'"{f.name}, what does {a(name)} say?" asked {h.name}.',
            f'"{cap(a(name))} says {sound}," said {f.name}.',
            f'"And where does {a(name)} live?" asked {h.name}.',
            f'"{cap(a(name))} lives {home}," said {f.name}. "Now you know!"',
        ]
    else:
        season, weather = rng.choice(W.SEASONS)
        game = rng.choice(W.HOBBIES)
        lines = [
            f'"Good morning, {f.name}!" said {h.name}. "How are you today?"',
            f'"I am {rng.choice(W.HAPPY_FEELINGS)}," said {f.name}. "It is {weather} today."',
            f'"Do you want to {game}?" asked {h.name}.',
            f'"Yes, let us {game} together," said {f.name}.',
        ]
    return "\n".join(lines)


GENERATORS = [
    (story, 6),
    (animal_fact, 2),
    (colour_fact, 1),
    (number_fact, 1),
    (calendar_fact, 1),
    (dialogue, 3),
]


def generate(num_docs: int = DEFAULT_DOCS, seed: int = 0) -> list[str]:
    """Returns ``num_docs`` documents; the same arguments always give the same documents."""
    rng = random.Random(seed)
    fns = [fn for fn, _ in GENERATORS]
    weights = [w for _, w in GENERATORS]
    return [rng.choices(fns, weights)[0](rng) for _ in range(num_docs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).with_name("corpus.txt")))
    p.add_argument("--docs", type=int, default=DEFAULT_DOCS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    docs = generate(args.docs, args.seed)
    text = DOC_SEPARATOR.join(docs) + "\n"
    Path(args.out).write_text(text)
    print(f"wrote {len(docs)} documents, {len(text)} characters to {args.out}")


if __name__ == "__main__":
    main()
