"""General English prompts for self-distillation, written here (never taken from Spec-Bench).

The stdlib/WMT prompts of :mod:`speculant.training.data` teach heads code and German; heads used
on chat-style English (Spec-Bench's writing, QA, summaries, maths, German→English translation)
need the target's English prose too. :func:`english_prompts` builds, deterministically, seven
families of instructions from hand-written topic lists, templated arithmetic word problems and
passages of the Python reference manual that ships with every Python (``pydoc_data.topics``):

* ``write``  – blog posts, emails, speeches, stories, persuasive paragraphs on everyday topics;
* ``explain`` – science/humanities explanations and comparisons;
* ``role``   – answer a question in the voice of a named character type;
* ``qa``     – short general-knowledge questions;
* ``math``   – multi-step arithmetic word problems with fresh numbers (seeded);
* ``summarize`` / ``rag`` – a reference-manual passage to summarise, or to answer a question from;
* ``de-en``  – German→English translation of given German sentences (e.g. the target's own German
  translations of the WMT prompts, so no evaluation sentence is used).

Families are interleaved so that any prefix of the list (an interrupted distillation) is balanced.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

__all__ = ["de_en_prompts", "english_prompt_families", "english_prompts", "german_sentences", "german_writing_prompts",
           "manual_passages", "more_chat_prompts"]

TOPICS = (
    "learning a second language as an adult", "working from home", "a weekend trip to the mountains",
    "starting a vegetable garden", "saving money on groceries", "the first day at a new job",
    "adopting a rescue dog", "training for a first marathon", "cooking for a large family dinner",
    "moving to a new city", "volunteering at a local library", "planning a wedding on a budget",
    "reducing plastic waste at home", "visiting Japan in spring", "learning to play the guitar",
    "a small bakery opening in the neighbourhood", "public transport in big cities", "online privacy",
    "the benefits of reading fiction", "getting enough sleep", "team sports for children",
    "renewable energy for households", "a museum of modern art", "electric cars",
    "the history of the bicycle", "camping with children", "remote-controlled drones",
    "a school science fair", "healthy breakfast habits", "the importance of friendship",
    "smartphones in classrooms", "a rainy day in London", "street food in Mexico City",
    "keeping a journal", "climbing an active volcano", "a career change at forty",
    "the four-day work week", "city parks", "board games", "a long train journey across Canada",
)

CONCEPTS = (
    "photosynthesis", "inflation", "the water cycle", "plate tectonics", "natural selection",
    "supply and demand", "the greenhouse effect", "compound interest", "vaccination", "black holes",
    "the French Revolution", "the Renaissance", "democracy", "the Industrial Revolution",
    "machine learning", "the immune system", "ocean tides", "the theory of relativity",
    "the placebo effect", "opportunity cost", "the Roman Empire", "DNA replication", "electric circuits",
    "the Cold War", "cognitive biases", "the printing press", "antibiotic resistance", "gravity",
    "the scientific method", "globalization", "nuclear fusion", "the human heart", "volcanoes",
    "the stock market", "climate and weather", "the Silk Road", "impressionist painting",
    "the separation of powers", "entropy", "urbanization",
)

PERSONAS = (
    "a pirate captain", "a medieval knight", "a famous detective", "a friendly robot", "a wise old wizard",
    "a professional chef", "an astronaut on the Moon", "a tour guide in Rome", "a grumpy cat",
    "a sports commentator", "a Shakespearean actor", "a time traveller from the year 3000",
)

QUESTIONS = (
    "What do you think about modern technology?", "How should a person spend a perfect Sunday?",
    "What is the secret of a happy life?", "What advice would you give to a young student?",
    "Why do people like to travel?", "What is your favourite food, and why?",
    "How do you deal with a difficult day?", "What makes a good leader?",
)

QA = (
    "Who wrote the novel Pride and Prejudice?", "What is the capital of Australia?",
    "How many planets are there in the solar system?", "Who painted the Mona Lisa?",
    "What is the longest river in Africa?", "When did the Second World War end?",
    "Who was the first person to walk on the Moon?", "What is the chemical symbol for gold?",
    "Which ocean is the largest?", "Who discovered penicillin?", "What language is spoken in Brazil?",
    "How many bones are there in the adult human body?", "Who composed the Four Seasons?",
    "What is the tallest mountain in the world?", "In which country are the pyramids of Giza?",
    "Who developed the theory of general relativity?", "What is the currency of Japan?",
    "Which planet is known as the Red Planet?", "Who was the first president of the United States?",
    "What is the boiling point of water at sea level?", "Where are the Olympic Games of 2012 held?",
    "Who wrote Romeo and Juliet?", "What is the largest desert in the world?",
    "Which element has the atomic number 1?", "Who invented the telephone?",
    "What is the smallest country in the world?", "When did the Berlin Wall fall?",
    "Who played the lead role in the film Titanic?", "What is the speed of light?",
    "Which animal is the largest mammal?", "Who wrote One Hundred Years of Solitude?",
    "What is the capital city of Canada?", "How long does the Earth take to orbit the Sun?",
    "Who was Cleopatra?", "What does a thermometer measure?", "Which country has the largest population?",
    "Who is the author of the Harry Potter books?", "What is the main gas in the Earth's atmosphere?",
    "Where is the Great Barrier Reef?", "What sport is played at Wimbledon?",
)

WRITE = (
    "Write an engaging blog post about {t}.",
    "Draft a short, professional email to your manager about {t}.",
    "Write a persuasive paragraph arguing for {t}.",
    "Write a short story that involves {t}.",
    "Give me five practical tips about {t}, with one sentence of explanation each.",
    "Write a short speech for a community event on the topic of {t}.",
)

EXPLAIN = (
    "Explain {c} in simple terms, as if to a high-school student.",
    "What is {c}, and why does it matter?",
    "Describe the main causes and effects of {c}.",
    "Give a short overview of {c} and one real-world example.",
)

MATH = (
    "{a} friends share a bill of ${b}. Each also leaves a tip of ${c}. How much does each friend pay "
        "in total?",
    "A shop sells notebooks for ${a} each. Maria buys {b} notebooks and pays with a ${c}0 note. How much "
        "change does she get?",
    "Tom reads {a} pages on Monday and twice as many on Tuesday. On Wednesday he reads {b} pages fewer "
        "than on Tuesday. How many pages did he read in the three days?",
    "A farmer has {a} chickens and {b} cows. How many legs do the animals have altogether?",
    "A train travels at {a} miles per hour for {b} hours and then at {c} miles per hour for 2 hours. "
        "How far does it travel?",
    "Lisa earns ${a} an hour. She works {b} hours a week and spends ${c} a week on rent. How much "
        "money is left after 4 weeks?",
    "A box holds {a} apples. A store receives {b} boxes and sells {c} apples. How many apples are left?",
    "John is {a} years old. His sister is {b} years younger, and their father is three times as old "
        "as John. What is the sum of their ages?",
)


QA2 = (
    "who sang the song hotel california", "when was the eiffel tower built", "how many players are on a soccer team",
    "who wrote the declaration of independence", "what is the largest organ in the human body",
    "where is the headquarters of the united nations", "who was the lead singer of queen",
    "when did the titanic sink", "how many states are there in the usa", "who invented the light bulb",
    "what is the national animal of scotland", "who directed the movie jaws", "when did the first iphone come out",
    "what is the hardest natural substance", "who is known as the father of computers",
    "how many teeth does an adult human have", "which river flows through paris", "who wrote the odyssey",
    "what is the freezing point of water in fahrenheit", "when did india gain independence",
    "who was the first woman to win a nobel prize", "what is the capital of new zealand",
    "how many keys does a piano have", "who painted the starry night", "what does dna stand for",
    "where do kangaroos live in the wild", "who built the first airplane", "when was the internet invented",
    "what is the main ingredient of guacamole", "which continent is egypt in", "who wrote the hobbit",
    "how long is a marathon", "who discovered gravity", "what is the largest city in the united states",
    "when did the roman empire fall", "what is the fastest land animal", "who sang thriller",
    "how many hearts does an octopus have", "which planet has the most moons", "who founded microsoft",
    "what language has the most native speakers", "when did the american civil war start",
    "where is mount kilimanjaro", "who was the greek god of the sea", "what is the square root of 144",
    "who wrote war and peace", "which country gifted the statue of liberty to the usa",
    "how many colors are in a rainbow", "who was the first emperor of china", "what is the currency of the uk",
    "when did humans first land on the moon", "who plays the guitar in the rolling stones",
    "what is the longest bone in the human body", "where was the first world cup held",
    "who is the greek goddess of wisdom", "what is the closest star to earth", "who wrote the communist manifesto",
    "how many strings does a violin have", "which metal is liquid at room temperature", "who created mickey mouse",
)

EXTRA_PROMPTS = (
    "Describe a perfect day in {t} in three paragraphs.",
    "List the pros and cons of {t}, then give your own conclusion.",
    "Write a short dialogue between two friends discussing {t}.",
)


# a third set of chat subjects (none in the lists above), for more chat and for German prose
TOPICS2 = (
    "learning to swim as an adult", "living in a tiny house", "a summer job at an ice-cream shop",
    "raising chickens in the backyard", "a cooking class for beginners", "repairing an old bicycle",
    "a family reunion", "running a small online shop", "the first snow of winter", "a visit to the dentist",
    "birdwatching", "a power cut in the evening", "learning to drive", "a music festival in the rain",
    "a neighbourhood clean-up day", "keeping houseplants alive", "a night at the theatre",
    "a lost wallet that was returned", "a job interview", "building a treehouse", "a trip to the seaside",
    "a carpool to work", "baking bread at home", "a village market", "a power nap at lunchtime",
    "buying a used car", "a chess club at school", "a hiking trip that went wrong", "an old family recipe",
    "a library that stays open all night", "a language exchange partner", "a snowed-in weekend",
    "a charity run", "winter in a northern city", "a first podcast episode", "a bicycle-friendly city",
    "a kitchen renovation", "a surprise birthday party", "a week without social media", "a night sky full of stars",
)
CONCEPTS2 = (
    "the Big Bang", "cell division", "the Pythagorean theorem", "interest rates", "the carbon cycle",
    "the Enlightenment", "solar panels", "earthquakes", "the nervous system", "game theory",
    "the Great Depression", "probability", "the ozone layer", "sound waves", "the Magna Carta",
    "photosynthesis in the ocean", "public-key cryptography", "the Renaissance in Florence", "the Internet",
    "memory and forgetting", "coral reefs", "the gold standard", "hurricanes", "the periodic table",
    "the Reformation", "jet engines", "biodiversity", "taxes", "the moon's phases", "the blood types",
    "the Olympic Games in antiquity", "weather forecasting", "the human genome", "the metric system",
    "free trade", "the Apollo programme", "rainbows", "the printing of money", "sleep cycles", "the Vikings",
)
PERSONAS2 = (
    "a lighthouse keeper", "a Roman senator", "a jazz musician from the 1920s", "a kindergarten teacher",
    "a mountain guide", "a news anchor", "a retired sea captain", "an enthusiastic gardener",
)
QUESTIONS2 = (
    "What is the best way to learn something new?", "What should everyone know how to cook?",
    "How do you stay calm under pressure?", "What makes a place feel like home?",
    "What would you change about your city?", "What is the most useful invention?",
    "How should friends settle an argument?", "What do you do on a rainy afternoon?",
)
QA3 = (
    "Who wrote the novel Don Quixote?", "What is the capital of Argentina?", "How many continents are there?",
    "Who painted the ceiling of the Sistine Chapel?", "What is the largest lake in Africa?",
    "When did the French Revolution begin?", "Who was the first person in space?",
    "What is the chemical formula of water?",
    "Which is the smallest planet in the solar system?", "Who discovered the electron?",
    "What language is spoken in Austria?", "How many chambers does the human heart have?",
    "Who composed the Ninth Symphony with the Ode to Joy?", "What is the deepest point in the ocean?",
    "In which city is the Colosseum?", "Who proposed the theory of evolution by natural selection?",
    "What is the currency of Switzerland?", "Which planet has the largest rings?", "Who was Nelson Mandela?",
    "At what temperature does water freeze in Celsius?", "Who wrote the play Hamlet?",
    "What is the largest country by area?", "Which gas do plants take in from the air?",
    "Who invented the printing press?", "What is the oldest university in Europe?",
    "When did the first airplane fly?", "Who wrote the novel 1984?", "What is the highest waterfall in the world?",
    "How many minutes are there in a day?", "What is the capital of Kenya?", "Who was Marie Curie?",
    "What does a barometer measure?", "Which country is home to the kangaroo?", "Who designed the Eiffel Tower?",
    "What is the main language of Mexico?", "How many sides does a hexagon have?",
    "Who was the Greek god of the sky?", "What is the largest moon of Saturn?",
    "Which instrument has 88 keys?", "Who was the first female prime minister of the United Kingdom?",
)
GERMAN_WRITE = (
    "Write a short paragraph in German (four to six sentences) about {t}.",
    "Write a short, friendly letter in German to a friend about {t}.",
)


def more_chat_prompts() -> list[str]:
    """Chat prompts on the third set of subjects (writing, explanations, role play, questions): none
    is a prompt of :func:`english_prompt_families`."""
    templates = WRITE + EXTRA_PROMPTS
    return ([tpl.format(t=t) for i, t in enumerate(TOPICS2) for j, tpl in enumerate(templates) if (i + j) % 3 == 0]
            + [tpl.format(c=c) for c in CONCEPTS2 for tpl in EXPLAIN]
            + [f"Pretend to be {p} for the rest of this conversation and speak like one. {q}"
               for i, p in enumerate(PERSONAS2) for j, q in enumerate(QUESTIONS2) if (i + j) % 2 == 0]
            + list(QA3))


def german_writing_prompts() -> list[str]:
    """Requests for short German prose on every subject: the target's German answers, split into
    sentences (:func:`german_sentences`), are sources for German→English prompts that no evaluation
    set holds."""
    subjects = TOPICS + TOPICS2 + CONCEPTS + CONCEPTS2
    return [tpl.format(t=t) for t in subjects for tpl in GERMAN_WRITE]


_GERMAN_WORDS = frozenset("der die das und ist nicht ich wir sie es ein eine einen mit auf für zu von den dem im "
                          "sich auch du ihr sind hat haben wird war man aber oder wenn dass kann sehr noch nur wie "
                          "bei".split())


def german_sentences(text: str, min_words: int = 5, max_words: int = 40) -> list[str]:
    """The sentences of German prose ``text`` that can stand alone as translation sources: one line
    of words (no markdown, no heading, no trailing colon), ``min_words`` to ``max_words`` words, at
    least two of them common German words (so an English or code line is left out)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or re.match(r"[#*\-|>`\d]", line):
            continue
        for s in re.split(r"(?<=[.!?])\s+(?=[A-ZÄÖÜ])", line):
            words = s.split()
            if (min_words <= len(words) <= max_words and s[-1] in ".!?" and not re.search(r"[*_`#|<>{}]", s)
                    and sum(w.strip(",.!?;:").lower() in _GERMAN_WORDS for w in words) >= 2):
                out.append(s)
    return out


def manual_passages(min_words: int = 80, max_words: int = 220, limit: int | None = None) -> list[tuple[str, str]]:
    """(topic, passage) pairs: prose paragraphs of the Python reference manual shipped with Python
    ``pydoc_data.topics``), joined up to ``max_words``; code-like paragraphs dropped."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a minimal Python build without pydoc data
        return []
    out: list[tuple[str, str]] = []
    for name in sorted(topics):
        paras = [" ".join(p.split()) for p in topics[name].split("\n\n")]
        prose = [p for p in paras if len(p.split()) >= 12 and not re.search(r"[{}=]|>>>|\*\*\*|^\W", p)]
        chunk: list[str] = []
        for p in prose:
            chunk.append(p)
            words = sum(len(c.split()) for c in chunk)
            if words >= min_words:
                text = " ".join(chunk)
                out.append((name, " ".join(text.split()[:max_words])))
                chunk = []
    return out[:limit]


def de_en_prompts(german: Sequence[str]) -> list[str]:
    """German→English translation prompts of the non-empty ``german`` sentences."""
    return [f"Translate German to English: {g.strip()}" for g in german if g.strip()]


def english_prompt_families(german: Sequence[str] = (), seed: int = 0, part: int = 0) -> dict[str, list[str]]:
    """Every prompt family (see the module docstring) by name; deterministic for ``seed``.

    ``part`` 0 is the set the shipped heads were first trained on; part 1 holds the topic/template
    combinations part 0 left out, new questions, new numbers, the passages' other use and a few
    more templates (no prompt of part 0, so the two sets add up)."""
    if part not in (0, 1):
        raise ValueError(f"part must be 0 or 1 (two disjoint prompt sets), got {part!r}")
    rng = random.Random(seed if part == 0 else f"{seed}/{part}")
    math = []
    for i in range(120):
        text = MATH[i % len(MATH)]
        a, b, c = rng.randint(3, 12), rng.randint(2, 9), rng.randint(4, 30)
        math.append(text.format(a=a, b=b * a if "bill" in text else b, c=c))
    passages = manual_passages()
    summ, rag = (passages[0::2], passages[1::2]) if part == 0 else (passages[1::2], passages[0::2])
    write = [tpl.format(t=t) for i, t in enumerate(TOPICS) for j, tpl in enumerate(WRITE) if (i + j) % 3 == part]
    if part:
        write += [tpl.format(t=t) for i, t in enumerate(TOPICS) for j, tpl in enumerate(EXTRA_PROMPTS)
                  if (i + j) % 3 == 0]
    return {
        "write": write,
        "explain": [tpl.format(c=c) for i, c in enumerate(CONCEPTS) for j, tpl in enumerate(EXPLAIN)
                    if (i + j) % 2 == part],
        "role": [f"Pretend to be {p} for the rest of this conversation and speak like one. {q}"
                 for i, p in enumerate(PERSONAS) for j, q in enumerate(QUESTIONS) if (i + j) % 3 == part],
        "qa": list(QA if part == 0 else QA2),
        "math": math,
        "summarize": [f"Summarize: {p}" for _, p in summ],
        "rag": [f"{p}\n\nBased on the passage above, what does it say about {topic.replace('-', ' ')}, and why is "
                "it important?" for topic, p in rag],
        "de-en": de_en_prompts(german),
    }


def english_prompts(german: Sequence[str] = (), seed: int = 0, block: int = 1, part: int = 0) -> list[str]:
    """The families interleaved ``block`` prompts at a time (so that any prefix of the list, e.g. an
    interrupted distillation, is balanced; a batched distillation wants ``block`` = its batch size,
    so that one batch holds answers of similar length)."""
    families = list(english_prompt_families(german, seed, part).values())
    out: list[str] = []
    for i in range(0, max(map(len, families)), block):
        out += [p for f in families for p in f[i:i + block]]
    return list(dict.fromkeys(out))
