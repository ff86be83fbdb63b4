"""Prompts for self-distillation, made offline: topics × request forms, questions the target
writes itself (self-instruct), and coding requests from the installed packages' docs.

Held-out prompts are separated by *topic*, not by line: a topic is held out when the sha256 of
its name is 0 mod 8, and every topic of the benchmark's held-out chat and code prompts
(``specdec.held_out.HELD_OUT``/``HELD_OUT_CODE``: the sky, sleep, hiking, …) is left out of
training altogether (``BENCH_TOPICS``). ``held_out(kind)`` gives a held-out set of its own,
made the same way as the training prompts but from held-out topics only.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from pathlib import Path

from specdec.errors import ConfigError
from specdec.held_out import HELD_OUT, HELD_OUT_CODE

# Everyday topics, by area (hand-written; the hub and its datasets are unreachable here).
TOPICS = {
    "science": "black holes, photosynthesis, plate tectonics, the periodic table, DNA, electricity, magnets, rainbows, volcanoes, "
    "earthquakes, the moon's phases, gravity, sound waves, the speed of light, evolution, bacteria, the human heart, the brain, "
    "ocean tides, comets, the solar system, atoms, chemical reactions, friction, static electricity, fossils, glaciers, deserts, "
    "coral reefs, rainforests, the ozone layer, nuclear energy, solar panels, wind turbines, batteries, microscopes, telescopes",
    "health": "drinking enough water, stretching, running for beginners, healthy breakfasts, stress at work, eye strain, "
    "posture at a desk, vitamins, strength training, meditation, walking every day, reducing sugar, seasonal allergies, "
    "first aid for small cuts, staying active when working from home, keeping teeth healthy, healthy snacks, yoga",
    "home": "cleaning a kitchen, organizing a closet, houseplants, saving energy at home, painting a room, fixing a leaky tap, "
    "decluttering, moving to a new apartment, composting, growing tomatoes, caring for a dog, caring for a goldfish, "
    "training a puppy, doing laundry, ironing shirts, keeping a home warm in winter, a small balcony garden",
    "food": "baking bread, making pasta from scratch, a vegetarian lunch, soup for a cold day, pancakes, storing leftovers, "
    "spices, making coffee, brewing tea, a picnic menu, cooking for a crowd, a birthday cake, salad dressings, fermenting "
    "vegetables, grilling fish, a quick breakfast, meal planning for a week, chocolate, cheese, olive oil",
    "money": "making a budget, saving for a holiday, credit cards, compound interest, renting versus buying, an emergency "
    "fund, comparing phone plans, negotiating a salary, starting a small business, taxes for freelancers, shopping on sale",
    "work": "writing a cover letter, a job interview, working in a team, giving feedback, time management, running a "
    "meeting, writing a clear email, asking for a raise, remote work, changing careers, learning a new skill, a first day at "
    "a new job, dealing with a difficult coworker, writing a report, presenting to a manager",
    "learning": "learning a foreign language, studying for an exam, taking notes, reading more books, learning to play "
    "the guitar, learning to draw, memorizing facts, writing an essay, learning math, teaching a child to read, online courses",
    "history": "the Roman Empire, ancient Egypt, the printing press, the industrial revolution, the first airplanes, the "
    "history of the internet, the Silk Road, medieval castles, the Renaissance, the invention of the telephone, the history "
    "of money, the Olympic Games, the first moon landing, the history of chess",
    "travel": "traveling by train, a city break in Europe, camping, packing a carry-on bag, traveling on a budget, jet lag, "
    "a road trip, visiting a museum, learning phrases before a trip, staying safe while traveling, traveling with children, "
    "a beach holiday, visiting Japan, visiting Mexico, a ski trip",
    "society": "recycling, voting, volunteering, public libraries, city parks, public transport, renewable energy, "
    "friendship, being a good neighbor, social media, online privacy, fake news, climate change, traffic",
    "arts": "writing a short story, photography for beginners, jazz, classical music, painting with watercolors, poetry, "
    "movies, theater, knitting, pottery, writing song lyrics, dancing, comic books, architecture",
    "technology": "smartphones, passwords, backing up files, how Wi-Fi works, cloud storage, electric cars, 3D printing, "
    "robots, artificial intelligence, video games, spreadsheets, choosing a laptop, email spam, GPS, QR codes",
    "nature": "birds, bees, trees in autumn, mountains, rivers, the seasons, whales, butterflies, wolves, snow, thunderstorms, "
    "the night sky, forests, insects, penguins, elephants, sharks",
    "life": "making friends as an adult, planning a party, writing a thank-you note, keeping a journal, a daily schedule, "
    "staying motivated, setting goals, saying no politely, a long-distance friendship, a family dinner, a wedding toast, "
    "choosing a gift, a rainy day at home, moving to a new city, learning to cook",
}

# Topics of the benchmark's held-out prompts (specdec/held_out.py): never trained on.
BENCH_TOPICS = {"the sky", "sleep", "hiking", "weather", "climate", "autumn leaves", "vaccines", "the immune system", "inflation",
                "rice", "public speaking", "the water cycle", "morning routines", "cats", "prime numbers", "reversing words",
                "fibonacci numbers", "vowels", "merging sorted lists", "list comprehensions", "bank accounts", "removing duplicates"}  # fmt: skip

FORMS = (
    "Explain {t} to a beginner.",
    "Give me three tips about {t}.",
    "What are the most common mistakes people make with {t}?",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.",
    "Summarize the key facts about {t} in a few sentences.",
    "I am new to {t}. Where should I start?",
    "Describe {t} to a ten-year-old.",
    "List five interesting facts about {t}.",
    "Write a short blog post introduction about {t}.",
    "What questions should I ask an expert on {t}?",
    "Compare {t} today with {t} fifty years ago.",
    "Write a friendly email to a friend about {t}.",
    "What is a common myth about {t}, and what is the truth?",
)

# The target writes a question of its own for a topic (self-instruct); its answer is kept only if it looks like one.
SELF_INSTRUCT = "Write one question that a curious person might ask about {t}. Reply with the question only."

# Forms "questions": the short, direct requests of everyday chat ("Why is ...?", "How can I ...?"), which the
# templates above (instructions about a topic) leave out. On SmolLM2 the stage-2 head read ~2.0 tokens a call on
# held-out prompts of the template forms and 1.7 on direct questions (docs/training-drafters.md); a corpus made
# with --forms questions adds their kind. Several self-instruct asks per topic: the target's own phrasings.
QUESTION_FORMS = (
    "What should I know about {t}?",
    "Why should I care about {t}?",
    "How can I learn more about {t}?",
    "Can you tell me about {t}?",
    "What is the most surprising thing about {t}?",
    "How would you explain {t} in simple words?",
    "What are some tips for {t}?",
    "Tell me something interesting about {t}.",
    "Help me understand {t}.",
    "Suggest a fun activity related to {t}.",
    "Write a haiku about {t}.",
    "What is the history of {t}?",
)
INSTRUCT_FORMS = (
    SELF_INSTRUCT,
    "Write one 'why' or 'how' question that a beginner might ask about {t}. Reply with the question only.",
    "Write one practical question that someone might ask a friend about {t}. Reply with the question only.",
    "Write one short question about {t} that a child might ask. Reply with the question only.",
)
CODE_QUESTION_FORMS = ("Can you write a Python function that {t}?", "Show me Python code that {t}.")
# Forms "everyday": the many shapes of a person's everyday request, written here to widen what the templates and
# questions cover (checklists, plans, advice, rhymes, dialogues, opinions, step-by-step help, quizzes, analogies).
# Stage 3's direct questions moved the benchmark's chat prompts little (1.71 -> 1.75 tokens a call): the forms
# seen in training were still few. None of these is a benchmark prompt's wording, and its topics stay excluded.
EVERYDAY_FORMS = (
    "How does {t} work?", "Why do people like {t}?", "Is {t} worth the effort? Be honest.", "What do I need to get started with {t}?",
    "Give me a step-by-step guide to {t}.", "Make a checklist for {t}.", "What are the benefits of {t}?",
    "What are the main problems with {t}, and how can they be solved?", "Explain {t} in one paragraph.",
    "What do most people get wrong about {t}?", "Plan a weekend around {t}.", "Write a limerick about {t}.",
    "Write a four-line rhyme about {t} for a birthday card.", "Describe {t} using only simple words.",
    "What would the world be like without {t}?", "Give me a fun fact about {t} that I can share at dinner.",
    "Write a short dialogue between two friends talking about {t}.", "What is the best advice you have about {t}?",
    "How has {t} changed over the years?", "What are five words that describe {t}, and why?",
    "My friend says {t} is boring. How can I change their mind?", "Create a short quiz with three questions about {t}.",
    "What should a beginner avoid when it comes to {t}?", "Write a motivational message about {t}.",
    "How would you teach {t} to a group of adults?", "What are the first three things to do about {t}?",
    "Explain why {t} matters in everyday life.", "Write a tweet about {t}.", "Give me an analogy that explains {t}.",
    "What are some good books or resources about {t}?",
)

CODE_TASKS = (
    "sorts a list of dictionaries by a given key", "counts the words in a text file", "checks whether a string is a palindrome",
    "finds the largest number in a list without using max", "converts Celsius to Fahrenheit", "flattens a nested list",
    "returns the factorial of n", "parses a date string in the format YYYY-MM-DD", "computes the average of a list of numbers",
    "checks whether two strings are anagrams", "finds the most common element in a list", "reads a CSV file into a list of dicts",
    "removes punctuation from a string", "computes the greatest common divisor of two numbers", "generates a random password",
    "splits a list into chunks of size n", "capitalizes the first letter of every word", "checks whether a year is a leap year",
    "returns the second largest number in a list", "counts how many times each character appears in a string",
    "transposes a matrix given as a list of lists", "validates an email address with a regular expression",
    "computes the sum of the digits of an integer", "finds all pairs in a list that sum to a target",
    "converts a decimal number to binary", "implements binary search on a sorted list", "rotates a list by k positions",
    "merges two dictionaries", "computes a running total of a list", "returns the unique words of a sentence in order",
    "implements a simple stack class", "implements a queue with two stacks", "checks whether brackets in a string are balanced",
    "computes the power set of a small list", "counts the lines in a file that contain a given word", "implements bubble sort",
    "returns the n-th row of Pascal's triangle", "converts a Roman numeral to an integer", "writes a dictionary to a JSON file",
    "finds the longest word in a sentence", "computes the distance between two points", "simulates rolling two dice",
)
CODE_FORMS = (
    "Write a Python function that {t}.", "Write a Python function that {t}, with a docstring and an example call.",
    "How would you write Python code that {t}? Explain each step.", "Write a short Python script that {t} and prints the result.",
)
FORM_SETS = {"templates": (FORMS, (SELF_INSTRUCT,), CODE_FORMS), "questions": (QUESTION_FORMS, INSTRUCT_FORMS, CODE_QUESTION_FORMS),
             "user-turns": ((), (), CODE_QUESTION_FORMS), "everyday": (EVERYDAY_FORMS, (), CODE_QUESTION_FORMS)}  # fmt: skip
# Forms "user-turns" (Magpie: Xu et al., 2024): the target writes the whole user turn, sampled from its chat
# template cut where the user's text would begin, so the requests are the kind its own chat tuning saw, not our
# templates over topics. On SmolLM2 the head's first draft was right at 0.63 of held-out positions of the template
# forms and at 0.49 on the benchmark's everyday questions (docs/training-drafters.md). The topic only splits them
# (held out by its hash, as the others); it is not in the prompt.
USER_TURNS = {"user-turns": 8}  # requests per topic whose user turn the target writes


def topics() -> list[str]:
    return [t.strip() for area in TOPICS.values() for t in area.split(",") if t.strip() not in BENCH_TOPICS]


def is_held_out(topic: str) -> bool:
    """A topic is held out when the sha256 of its name is 0 mod 8: about 1 in 8."""
    return int(hashlib.sha256(topic.encode()).hexdigest(), 16) % 8 == 0


def _docs_requests(limit: int, seed: int) -> list[tuple[str, str]]:
    """(topic, request) from installed public functions' docstrings: write it, or explain it with an example.
    The topic is the module's name, so a module's requests are all held out or all trained on."""
    if limit <= 0:
        return []
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = sorted(p for r in roots for p in r.rglob("*.py") if "test" not in p.as_posix().lower())
    random.Random(seed).shuffle(files)
    out: list[tuple[str, str]] = []
    for path in files[: 4 * limit]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError, RecursionError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node) or ""
            para = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if 30 <= len(para) <= 300 and para.isascii():
                form = (f"Write a Python function `{node.name}` that does the following: {para}" if len(out) % 2 == 0
                        else f"I am reading documentation that says: \"{para}\" Can you explain it with an example?")  # fmt: skip
                out.append((f"module {path.stem}", form))
                break
        if len(out) >= limit:
            break
    return out


def requests(held_out: bool, seed: int = 0, docs: int = 1500, forms: str = "templates") -> list[dict]:
    """Every templated request of the chosen side of the topic split, shuffled: dicts with
    ``topic``, ``kind`` ("chat"/"code") and ``prompt`` (or ``instruct``: a self-instruct request
    whose question the target writes first; or ``user_turn``: the target writes the whole user
    turn). ``forms``: a key of FORM_SETS."""
    if forms not in FORM_SETS:
        raise ConfigError(f"forms {forms!r}: expected one of {', '.join(FORM_SETS)}")
    chat, instruct, code = FORM_SETS[forms]
    out = []
    for t in topics():
        if is_held_out(t) != held_out:
            continue
        out += [{"topic": t, "kind": "chat", "prompt": f.format(t=t)} for f in chat]
        out += [{"topic": t, "kind": "chat", "instruct": f.format(t=t)} for f in instruct]
        out += [{"topic": t, "kind": "chat", "user_turn": True} for _ in range(USER_TURNS.get(forms, 0))]
    for task in CODE_TASKS:
        if is_held_out(task) == held_out:
            out += [{"topic": task, "kind": "code", "prompt": f.format(t=task)} for f in code]
    for topic, prompt in _docs_requests(docs, seed):
        if is_held_out(topic) == held_out:
            out.append({"topic": topic, "kind": "code", "prompt": prompt})
    random.Random(seed).shuffle(out)
    return out


def looks_like_question(text: str) -> bool:
    """A self-instruct answer kept as a prompt: one line of 3 to 40 words ending in '?'."""
    text = text.strip().strip('"')
    return "\n" not in text and text.endswith("?") and 3 <= len(text.split()) <= 40


def looks_like_request(text: str) -> bool:
    """A user turn the target wrote, kept as a prompt: one paragraph of 4 to 60 words ending as a
    sentence does, with no role marker of a dialogue it went on to write, and none of the
    benchmark's own requests (specdec/held_out.py)."""
    text = text.strip()
    return ("\n" not in text and text[-1:] in "?.!" and 4 <= len(text.split()) <= 60 and ":" not in text.split()[0]
            and text.lower() not in {t.lower() for t in HELD_OUT + HELD_OUT_CODE})  # fmt: skip


def held_out(kind: str, count: int, seed: int = 0, forms: str = "templates") -> list[str]:
    """``count`` held-out prompts of ``kind`` ("chat" or "code"), from held-out topics only."""
    pool = [r["prompt"] for r in requests(held_out=True, seed=seed, docs=300 if kind == "code" else 0, forms=forms)
            if r["kind"] == kind and "prompt" in r]  # fmt: skip
    return pool[:count]
