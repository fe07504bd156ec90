"""The search tool: BM25 over a local corpus, so a search task runs offline and scores the same every time.

The corpus is a JSON-lines file of documents `{"id", "title", "text"}`; the one shipped
(`mcore_rl/assets/search/corpus.jsonl`, 40 short encyclopedic entries: planets, elements, capitals,
constants) serves tests and demos, and a task points `Search(path)` at its own. Ranking is Okapi BM25
(k1 = 1.5, b = 0.75) over lower-cased words of the title and text; a query with no word in the corpus
is answered "no results".
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any

from mcore_rl.data.files import strict_jsonl
from mcore_rl.data.tool_calls import ToolSpec
from mcore_rl.envs.tools.toolset import Tool, ToolError

DEFAULT_CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "search", "corpus.jsonl")
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


class BM25Index:
    """Okapi BM25 over a fixed list of documents."""

    def __init__(self, documents: list[Document], k1: float = 1.5, b: float = 0.75) -> None:
        if not documents:
            raise ValueError("a search corpus needs at least one document")
        self.documents, self.k1, self.b = documents, k1, b
        self.terms = [Counter(words(f"{d.title} {d.text}")) for d in documents]
        self.lengths = [sum(t.values()) for t in self.terms]
        self.mean_length = sum(self.lengths) / len(documents)
        df = Counter(w for t in self.terms for w in t)
        n = len(documents)
        self.idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}

    def search(self, query: str, k: int) -> list[tuple[float, Document]]:
        q = [w for w in set(words(query)) if w in self.idf]
        scored = []
        for doc, tf, length in zip(self.documents, self.terms, self.lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self.mean_length)
            score = sum(self.idf[w] * tf[w] * (self.k1 + 1) / (tf[w] + norm) for w in q if w in tf)
            if score > 0:
                scored.append((score, doc))
        scored.sort(key=lambda sd: (-sd[0], sd[1].id))
        return scored[:k]


def read_corpus(path: str) -> list[Document]:
    """The documents of a JSON-lines corpus; a ValueError naming `file:line` for a bad one."""
    docs = []
    for lineno, bad, row in strict_jsonl(path, "a document {id, title, text}"):
        if "id" not in row or "text" not in row:
            bad.fail(lineno, f"no {'id' if 'id' not in row else 'text'} field")
        docs.append(Document(str(row["id"]), str(row.get("title", "")), str(row["text"])))
    return docs


@cache
def _index(path: str) -> BM25Index:
    return BM25Index(read_corpus(path))


class Search(Tool):
    spec = ToolSpec(
        name="search",
        description="Search a local encyclopedia; returns the best matching entries.",
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1},
                "k": {"type": "integer", "minimum": 1, "maximum": 5, "description": "results (default 3)"},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    )

    def __init__(self, corpus: str = DEFAULT_CORPUS) -> None:
        self.index = _index(os.path.abspath(corpus))  # built once per corpus and process

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        hits = self.index.search(arguments["query"], int(arguments.get("k", 3)))
        if not hits:
            raise ToolError(f"no results for {arguments['query']!r}")
        return "\n".join(f"[{d.id}] {d.title}: {d.text}" for _, d in hits)
