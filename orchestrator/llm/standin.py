"""A stand-in model server: it speaks the Chat Completions protocol and plans with rules.

It is a stand-in for a real model, so that the harness, its agent task type and their tests
run offline and deterministically; point LLM_BASE_URL at a real server for real work
(docs/agent.md, "Models"). `python manage.py standin_llm --port 8011` serves it; `make run` starts it.

Protocol: `POST /v1/chat/completions` (streamed as server-sent events — `data: {chunk}` lines,
then `data: [DONE]` — or one JSON body), `GET /v1/models`, and the Responses API in background
mode: `POST /v1/responses` with `background` and `stream` (the answer is made and kept at once,
billed in full, and streamed as `response.*` events; the first, `response.created`, carries its
id) and `GET /v1/responses/{id}` (`in_progress` until its stream would have ended, then the
whole response with its usage), what a client that died mid-stream re-attaches to. Streams carry content pieces,
`tool_calls` fragments (id and name in the first, the arguments split over several), a
finish chunk and, when `stream_options.include_usage` is set, a usage chunk. Like real
servers it refuses a history in which an assistant's tool call has no `tool` answer.

Planning (`plan_next`) is stateless: everything is derived from the messages and the tools
offered, so the same conversation always gets the same answer, and it never calls a tool
that was not offered:
- a goal (the first user message) about contracts, with a tool that reads contracts
  (a name containing "contract" and read/get/fetch/open/load): list them (a tool with
  "contract" and list/search/find, if offered), read each (several calls per turn), total
  the amounts seen in the results per currency, send the summary with the email tool
  ("email"/"mail" in its name) to the address in the goal, store it with a memory write
  tool if the goal asks to remember it, then answer;
- any other goal: call the first tool whose name shares a word with the goal, then answer
  from its result; with no such tool, answer directly.

Fault modes, per request, as suffixes of the model name (`standin-planner+slow+429@1`):
  slow[=S]     S seconds per token (default 0.1) instead of the server's pace
  cut          the stream stops half way: the connection closes without the end or [DONE]
  no-usage     no usage chunk (nor `usage` in a JSON answer)
  429[=S]      HTTP 429 with `Retry-After: S` (default 1; fractions allowed)
  500          HTTP 500
  bad-json     the first tool call's arguments are malformed JSON
  unknown-tool a call to a tool that was not offered, instead of the plan
  legacy       HTTP 400 for `max_completion_tokens` (servers that only know `max_tokens`)
  no-stream-options  HTTP 400 for a request with `stream_options` (servers that refuse it)
  no-tools     HTTP 400 for a request with `tools` (a server without tool support)
  reasoning    reasoning deltas (`reasoning_content`) before the answer
  context_window=N  HTTP 400 `context_length_exceeded` for a request whose prompt passes N tokens
               (characters / 4, as the usage it reports), what a server with an N-token window says
  usage-scale=F  the usage it reports (and bills) counts F times the prompt tokens: a server whose
               tokenizer counts differently from characters / 4
  cached=N     N of the prompt tokens (at most all of them) were read from the server's prompt
               cache: reported as `prompt_tokens_details.cached_tokens` and billed as cached
  FAULT@N      only the Nth time this same request (same model, messages and tools) arrives,
               e.g. `+429@1`: the first attempt is refused, its retry is answered.

Server dialects, one at most, also suffixes (`standin-planner+ollama`): the same plan in the
shapes of streamed chunks other servers send (DIALECTS; what differs is from their code and
issue trackers):
  vllm         reasoning deltas as `reasoning` (vLLM >= 0.16; `reasoning_content` before),
               tool calls streamed in pieces (id and name first, no `arguments` key), ids
               `chatcmpl-tool-…`, `logprobs`/`stop_reason` on every choice, usage in a chunk of
               its own only when `stream_options.include_usage` asks;
  ollama       reasoning deltas as `reasoning` (with `content: ""` beside), every tool call
               complete in one chunk, `role` on every delta, `system_fingerprint: fp_ollama`,
               no usage chunk whatever the request asks;
  llamacpp     reasoning deltas as `reasoning_content`, the first delta's content null, each
               tool call complete in a chunk of its own, and the usage (with `timings`) inside
               the finish chunk, always, instead of a chunk of its own.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

STANDIN_MODEL = "standin-planner"
DEFAULT_PORT = 8011
DEFAULT_TOKEN_SECONDS = 0.005
SLOW_TOKEN_SECONDS = 0.1
ROUTES = "POST /v1/chat/completions, POST /v1/responses (background), GET /v1/responses/{id} and GET /v1/models"
DEFAULT_RETRY_AFTER_SECONDS = "1"
ARGUMENT_FRAGMENT_CHARACTERS = 8  # how tool-call arguments are split over chunks
CONTRACT_READS_PER_TURN = 5

FAULTS = ("slow", "cut", "no-usage", "429", "500", "bad-json", "unknown-tool", "legacy", "no-stream-options",
          "no-tools", "reasoning", "context_window", "usage-scale", "cached")


@dataclass(frozen=True)
class Dialect:
    """How a server shapes its streamed chunks (see the module doc)."""
    name: str
    reasoning_field: str | None = None  # the delta field of reasoning pieces; None: no reasoning
    whole_calls: bool = False           # a tool call's id, name and arguments in one delta
    calls_in_one_chunk: bool = False    # every tool call of the answer in the same delta
    usage: str = "chunk"                # "chunk": its own, if asked; "finish": in the finish chunk, always; "never"
    call_id_prefix: str = "call_"
    first_content: str | None = ""      # the first delta's `content`
    role_on_every_delta: bool = False
    choice_extra: tuple[tuple[str, Any], ...] = ()
    chunk_extra: tuple[tuple[str, Any], ...] = ()


OPENAI = Dialect("openai")
DIALECTS = {
    "vllm": Dialect("vllm", reasoning_field="reasoning", call_id_prefix="chatcmpl-tool-",
                    choice_extra=(("logprobs", None), ("stop_reason", None))),
    "ollama": Dialect("ollama", reasoning_field="reasoning", whole_calls=True, calls_in_one_chunk=True, usage="never",
                      role_on_every_delta=True, chunk_extra=(("system_fingerprint", "fp_ollama"),)),
    "llamacpp": Dialect("llamacpp", reasoning_field="reasoning_content", whole_calls=True, usage="finish",
                        call_id_prefix="", first_content=None, chunk_extra=(("system_fingerprint", "b6097-9515c613"),)),
}
_FAULT_PATTERN = re.compile(r"^(?P<name>[a-z0-9_-]+)(?:=(?P<value>[0-9.]+))?(?:@(?P<nth>[0-9]+))?$")


# --- fault modes -----------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    name: str
    value: str | None = None
    on_request: int | None = None  # only the Nth arrival of the same request; None: every time


def parse_model(model: str) -> tuple[str, dict[str, Fault]]:
    """`standin-planner+slow=0.2+429@1` -> ("standin-planner", {name: Fault}); ValueError
    naming the known faults for anything else."""
    base, *suffixes = (model or "").split("+")
    faults: dict[str, Fault] = {}
    for suffix in suffixes:
        match = _FAULT_PATTERN.match(suffix.strip().lower())
        if not match or match["name"] not in FAULTS + tuple(DIALECTS):
            raise ValueError(f"unknown fault mode {suffix!r} in model {model!r}; known: "
                             f"{', '.join(FAULTS)} (each optionally =VALUE and @N), and one of the dialects "
                             f"{', '.join(DIALECTS)}")
        faults[match["name"]] = Fault(match["name"], match["value"],
                                      int(match["nth"]) if match["nth"] else None)
    dialects = [name for name in faults if name in DIALECTS]
    if len(dialects) > 1:
        raise ValueError(f"model {model!r} names several dialects ({', '.join(dialects)}); a server speaks one")
    return base, faults


# --- planning --------------------------------------------------------------------------

@dataclass
class PlannedCall:
    name: str
    arguments: dict | str  # a str is sent as is (the bad-json fault)

    def arguments_text(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Plan:
    """The next assistant message: tool calls, or (with none) a final answer in `content`."""
    content: str = ""
    tool_calls: list[PlannedCall] = field(default_factory=list)
    reasoning: str = ""  # sent as reasoning deltas by the modes that reason (see _reasoning_text)


@dataclass
class _PastCall:
    id: str
    name: str
    arguments: dict
    result: str | None


@dataclass
class _Conversation:
    goal: str
    offered: dict[str, dict]  # tool name -> its JSON schema (`parameters`)
    calls: list[_PastCall]

    def calls_of(self, name: str) -> list[_PastCall]:
        return [call for call in self.calls if call.name == name]


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _read_conversation(messages: list[dict], tools: list[dict]) -> _Conversation:
    goal = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    offered = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name"):
            offered[function["name"]] = function.get("parameters") or {}
    results = {m.get("tool_call_id"): _text(m.get("content")) for m in messages if m.get("role") == "tool"}
    calls = []
    for message in messages:
        for call in message.get("tool_calls") or [] if message.get("role") == "assistant" else []:
            function = call.get("function") or {}
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError:
                arguments = {}
            calls.append(_PastCall(call.get("id", ""), function.get("name", ""),
                                   arguments if isinstance(arguments, dict) else {}, results.get(call.get("id"))))
    return _Conversation(goal, offered, calls)


def plan_next(messages: list[dict], tools: list[dict] | None = None) -> Plan:
    """The stand-in's decision for this conversation (see the module doc)."""
    summarise = _summary_plan(messages)
    if summarise is not None:
        return summarise
    conversation = _read_conversation(messages, tools or [])
    return (_read_on_plan(conversation) or _items_plan(conversation, messages) or _contracts_plan(conversation)
            or _generic_plan(conversation))


# --- long runs: a summary when asked to compact, and a goal of N items one per turn ---------

COMPACTION_MARK = "You compact an agent's dialog."  # the harness's summary prompt begins so
_ITEMS_GOAL = re.compile(r"\bitems? 1 to (\d+)\b", re.I)
_AFTER_ITEM = re.compile(r"\bafter item (\d+)\b", re.I)
_PROGRESS = re.compile(r"Progress: last item (\d+), running total (-?\d+)\.")
_ITEM_RESULT = re.compile(r'"item":\s*(\d+),\s*"value":\s*(-?\d+)')


def _summary_plan(messages: list[dict]) -> Plan | None:
    """Asked to summarise (the system prompt is the harness's compaction prompt): the progress of
    an items goal read from the text (an earlier summary's progress line, then the item results
    after it), and how many messages it covered. It never mentions side effects: what was done
    must reach the model through the harness's ledger."""
    if not messages or not _text(messages[0].get("content")).startswith(COMPACTION_MARK):
        return None
    text = "\n".join(_text(m.get("content")) for m in messages[1:])
    last, total = _progress(text)
    lines = text.count("\n[turn ")
    state = f"Progress: last item {last}, running total {total}." if last else "No items read yet."
    return Plan(content=f"(stand-in summary of {lines + 1} message(s)) {state}")


def _progress(text: str) -> tuple[int, int]:
    """(last item read, running total) from an earlier summary's progress line and the item results
    after it."""
    last, total, start = 0, 0, 0
    for match in _PROGRESS.finditer(text):
        last, total, start = int(match[1]), int(match[2]), match.end()
    for match in _ITEM_RESULT.finditer(text, start):
        item, value = int(match[1]), int(match[2])
        if item > last:
            last, total = item, total + value
    return last, total


def _items_plan(conversation: _Conversation, messages: list[dict]) -> Plan | None:
    """A goal of reading items 1 to N (a tool with "item" and a read verb), one per turn, keeping a
    running total; with an address and "after item K" in the goal, the total is emailed once past
    item K; then the answer is the total. State comes from the dialog: the summary's progress line
    and the item results since; whether the email went from the calls in view or the ledger."""
    goal = _ITEMS_GOAL.search(conversation.goal)
    reader = _find_tool(conversation.offered, must="item", verbs=_READ_VERBS)
    if goal is None or reader is None:
        return None
    count = int(goal[1])
    text = "\n".join(_text(m.get("content")) for m in messages if m.get("role") in ("user", "tool"))
    last, total = _progress(text)
    address = _EMAIL_PATTERN.search(conversation.goal)
    after = _AFTER_ITEM.search(conversation.goal)
    mailer = _find_tool(conversation.offered, must="email") or _find_tool(conversation.offered, must="mail")
    if address and after and mailer and last >= int(after[1]):
        ledger_says_sent = any(line.startswith("- ") and "email" in line and ": done" in line
                               for line in text.splitlines())
        if not conversation.calls_of(mailer) and not ledger_says_sent:
            return Plan(tool_calls=[PlannedCall(mailer, _arguments(
                conversation.offered[mailer], conversation.goal, recipient=address[0],
                subject=f"Running total after item {last}", body=f"The running total after item {last} is {total}."))])
    if last < count:
        return Plan(tool_calls=[PlannedCall(reader, {"item": last + 1})])
    return Plan(content=f"Read items 1 to {count}. The total is {total}.")


_READ_ON = re.compile(r'result_read\(ref="([^"]+)", offset=(\d+)\)')
READ_ON_PAGES = 3  # pages the stand-in reads of a shortened result before it answers


def _read_on_plan(conversation: _Conversation) -> Plan | None:
    """A tool result shortened for the prompt ends with how to read on (result_read): the stand-in
    reads a few pages of it, then answers with what the last page said."""
    if "result_read" not in conversation.offered:
        return None
    answered = [call for call in conversation.calls if call.result is not None]
    if not answered:
        return None
    last = answered[-1]
    pointer = _READ_ON.search(last.result or "")
    pages = [c for c in conversation.calls_of("result_read") if pointer and c.arguments.get("ref") == pointer.group(1)]
    if pointer and len(pages) < READ_ON_PAGES:
        return Plan(tool_calls=[PlannedCall("result_read", {"ref": pointer.group(1),
                                                            "offset": int(pointer.group(2))})])
    if last.name == "result_read" and not _is_error(last.result or ""):
        header, _, page = (last.result or "").partition("\n")
        return Plan(content=f"I read {len(conversation.calls_of('result_read'))} more page(s) of "
                            f"{last.arguments.get('ref', '')} {header} Its last page ends with: {page[-120:]}")
    return None


_READ_VERBS = ("read", "get", "fetch", "open", "load", "parse", "extract")
_LIST_VERBS = ("list", "search", "find", "all", "index")
_MEMORY_WRITE_VERBS = ("write", "store", "save", "remember", "put", "add", "set")
_EMAIL_PATTERN = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
                 "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15, "twenty": 20}


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def _find_tool(offered: dict[str, dict], *, must: str | None = None, verbs: tuple[str, ...] = ()) -> str | None:
    for name in offered:
        lowered = name.lower()
        if must and must not in lowered:
            continue
        if verbs and not any(verb in _words(name) or verb in lowered.replace(must or "", "") for verb in verbs):
            continue
        return name
    return None


def _contract_count(goal: str) -> int | None:
    match = re.search(r"\b(\d+|" + "|".join(_NUMBER_WORDS) + r")\s+(?:\w+\s+){0,2}contracts?\b", goal, re.I)
    if not match:
        return None
    word = match.group(1).lower()
    return int(word) if word.isdigit() else _NUMBER_WORDS[word]


def _contracts_plan(conversation: _Conversation) -> Plan | None:
    goal, offered = conversation.goal, conversation.offered
    if "contract" not in goal.lower():
        return None
    read_tool = _find_tool(offered, must="contract", verbs=_READ_VERBS)
    if read_tool is None:
        return None
    list_tool = _find_tool(offered, must="contract", verbs=_LIST_VERBS)
    if list_tool == read_tool:
        list_tool = None
    email_tool = (_find_tool(offered, must="mail", verbs=("send",)) or _find_tool(offered, must="mail"))
    memory_tool = _find_tool(offered, must="memory", verbs=_MEMORY_WRITE_VERBS)
    recipient_match = _EMAIL_PATTERN.search(goal)
    recipient = recipient_match.group(0).rstrip(".") if recipient_match else None
    count = _contract_count(goal)

    # 1. Which contracts: from the list tool's result, else numbered 1..N.
    contract_ids: list[Any] = []
    if list_tool:
        listed = conversation.calls_of(list_tool)
        if not listed:
            return Plan(tool_calls=[PlannedCall(list_tool, _arguments(offered[list_tool], goal, count=count))])
        contract_ids = _contract_ids(listed[-1].result or "")
    if not contract_ids and count:
        contract_ids = list(range(1, count + 1))
    if count:
        contract_ids = contract_ids[:count]
    if not contract_ids:
        return Plan(content="I found no contracts to read"
                            + (f" (the list tool answered: {_clip(listed[-1].result)})." if list_tool else "."))

    # 2. Read each one not read yet, a few per turn.
    read_arguments = [_arguments(offered[read_tool], goal, identifier=cid) for cid in contract_ids]
    done = {_canonical(call.arguments): call for call in conversation.calls_of(read_tool)}
    unread = [args for args in read_arguments if _canonical(args) not in done]
    if unread:
        return Plan(tool_calls=[PlannedCall(read_tool, args) for args in unread[:CONTRACT_READS_PER_TURN]])

    # 3. Total what the results say.
    summary = _contracts_summary([(cid, done[_canonical(args)].result or "")
                                  for cid, args in zip(contract_ids, read_arguments)])

    # 4. Send it, remember it if asked, answer.
    steps_done = []
    if email_tool and recipient:
        sent = conversation.calls_of(email_tool)
        if not sent:
            return Plan(tool_calls=[PlannedCall(email_tool, _arguments(
                offered[email_tool], goal, recipient=recipient,
                subject=f"Summary of {len(contract_ids)} contracts", body=summary))])
        outcome = sent[-1].result or ""
        steps_done.append(f"The email to {recipient} could not be sent: {_clip(outcome)}" if _is_error(outcome)
                          else f"I emailed the summary to {recipient}.")
    if memory_tool and re.search(r"\b(remember|memori[sz]e|note|keep)\b", goal, re.I):
        if not conversation.calls_of(memory_tool):
            return Plan(tool_calls=[PlannedCall(memory_tool, _arguments(
                offered[memory_tool], goal, key="contracts summary", body=summary))])
        steps_done.append("I stored the summary in memory.")
    return Plan(content="\n\n".join([summary, *steps_done]))


def _generic_plan(conversation: _Conversation) -> Plan:
    goal = conversation.goal
    answered = [call for call in conversation.calls if call.result is not None]
    if answered:
        last = answered[-1]
        return Plan(content=f"Here is what {last.name} returned: {_clip(last.result, 500)}")
    goal_words = {w for w in _words(goal) if len(w) >= 3}
    goal_words |= {w[:-1] for w in goal_words if w.endswith("s")}
    for name, schema in conversation.offered.items():
        if any(w in goal_words or w + "s" in goal_words for w in _words(name) if len(w) >= 3 and w not in
               {"get", "set", "the", "and", "for", "run", "tool"}):
            return Plan(tool_calls=[PlannedCall(name, _arguments(schema, goal))])
    return Plan(content=f"(stand-in model) No tool applies, so here is a direct answer to: {_clip(goal, 300)}")


# Which argument a property gets, by its name.
_ROLE_NAMES = {
    "identifier": ("id", "contract_id", "contract", "name", "path", "file", "filename", "key", "document_id"),
    "count": ("limit", "count", "n", "max", "max_results", "page_size", "top"),
    "recipient": ("to", "recipient", "recipients", "email", "address", "to_email", "to_address"),
    "subject": ("subject", "title"),
    "body": ("body", "text", "content", "message", "value", "summary", "fact"),
    "key": ("key", "name", "topic"),
}


def _arguments(schema: dict, goal: str, **values) -> dict:
    """Arguments for a tool from its JSON schema: each property gets the value of the role
    its name suggests; required properties left over get the goal (strings) or nothing."""
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    arguments: dict[str, Any] = {}
    for prop, spec in properties.items():
        lowered = prop.lower()
        value = None
        for role, names in _ROLE_NAMES.items():
            if values.get(role) is not None and (lowered in names or (role == "identifier" and lowered.endswith("_id"))):
                value = values[role]
                break
        if value is None:
            if prop in required and (spec or {}).get("type", "string") == "string":
                value = goal
            else:
                continue
        arguments[prop] = _coerce(value, spec or {})
    if not properties and values.get("identifier") is not None:
        arguments["id"] = values["identifier"]
    return arguments


def _coerce(value, spec: dict):
    kind = spec.get("type")
    if kind == "array":
        return value if isinstance(value, list) else [_coerce(value, spec.get("items") or {})]
    if kind == "integer":
        digits = re.findall(r"\d+", str(value))
        return int(digits[-1]) if digits else 0
    if kind == "string":
        return str(value)
    return value


def _canonical(arguments: dict) -> str:
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _contract_ids(result: str) -> list[Any]:
    try:
        data = json.loads(result)
    except ValueError:
        data = None
    if isinstance(data, dict):
        lists = [v for k, v in data.items() if isinstance(v, list)]
        preferred = [data[k] for k in ("contracts", "items", "results", "data", "files") if isinstance(data.get(k), list)]
        data = (preferred or lists or [None])[0]
    if isinstance(data, list):
        ids = []
        for item in data:
            if isinstance(item, (str, int)):
                ids.append(item)
            elif isinstance(item, dict):
                for key in ("id", "contract_id", "name", "file", "filename", "path"):
                    if item.get(key) is not None:
                        ids.append(item[key])
                        break
        return ids
    return list(dict.fromkeys(re.findall(r"\bcontract[_-]?\d+(?:\.txt)?", result, re.I)))


_CURRENCY_SYMBOLS = {"€": "EUR", "$": "USD", "£": "GBP"}
_CODES = "EUR|USD|GBP|CHF|JPY|SEK|NOK|DKK|CAD|AUD"
_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_AMOUNT_PATTERNS = (
    re.compile(rf"(?P<currency>{_CODES}|[€$£])\s?(?P<number>{_NUMBER})"),
    re.compile(rf"(?P<number>{_NUMBER})\s?(?P<currency>{_CODES})\b"),
)


def _amounts(result: str) -> list[tuple[str, float]]:
    """Every amount in a tool result: structured ({"amount": 5, "currency": "EUR"}) when the
    result is JSON that has them, else currency amounts found in the text."""
    try:
        data = json.loads(result)
    except ValueError:
        data = None
    found: list[tuple[str, float]] = []

    def as_number(value):
        # A model reads "12500.00" as a number too (decimal amounts often travel as strings).
        if isinstance(value, bool):
            return None
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and re.fullmatch(r"-?\d+(?:\.\d+)?", value.strip()):
            return float(value)
        return None

    def walk(node):
        if isinstance(node, dict):
            number = next((as_number(node[k]) for k in ("amount", "value", "total")
                           if as_number(node.get(k)) is not None), None)
            if number is not None and isinstance(node.get("currency"), str):
                found.append((node["currency"].upper(), number))
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(data)
    if found:
        return found
    taken: list[tuple[int, int]] = []
    for pattern in _AMOUNT_PATTERNS:
        for match in pattern.finditer(result):
            if any(start < match.end() and match.start() < end for start, end in taken):
                continue  # "EUR 5 EUR" is one amount, not two
            taken.append(match.span())
            currency = _CURRENCY_SYMBOLS.get(match["currency"], match["currency"])
            found.append((currency, float(match["number"].replace(",", ""))))
    return found


def _is_error(result: str) -> bool:
    lowered = result.strip().lower()
    if lowered.startswith(("error", "failed", "not found", "not executed", "skipped")):
        return True
    try:
        data = json.loads(result)
    except ValueError:
        return False
    return isinstance(data, dict) and bool(data.get("error"))


def _format_totals(totals: dict[str, float]) -> str:
    return "; ".join(f"{currency} {amount:,.2f}" for currency, amount in sorted(totals.items())) or "no amounts"


def _contracts_summary(results: list[tuple[Any, str]]) -> str:
    lines, totals, unreadable = [], {}, []
    for contract_id, result in results:
        if _is_error(result):
            unreadable.append(f"{contract_id} ({_clip(result, 80)})")
            continue
        per_contract: dict[str, float] = {}
        for currency, amount in _amounts(result):
            per_contract[currency] = per_contract.get(currency, 0.0) + amount
            totals[currency] = totals.get(currency, 0.0) + amount
        lines.append(f"- {contract_id}: {_format_totals(per_contract)}")
    text = f"Summary of {len(results)} contracts ({len(results) - len(unreadable)} read):\n" + "\n".join(lines)
    text += f"\nTotal of the amounts: {_format_totals(totals)}"
    if unreadable:
        text += "\nNot readable: " + ", ".join(unreadable)
    return text


def _reasoning_text(plan: Plan) -> str:
    """What a reasoning model would think before this plan: a short account of the decision."""
    if plan.tool_calls:
        names = ", ".join(dict.fromkeys(call.name for call in plan.tool_calls))
        return f"Thinking: the goal needs more facts before I can answer, so next I call {names}."
    return "Thinking: I have what the goal asks for, so I answer now without calling a tool."


def _clip(text: str | None, limit: int = 200) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- the wire --------------------------------------------------------------------------

def _content_pieces(text: str) -> list[str]:
    """The content as tokens: roughly one word (with its leading space) each."""
    return re.findall(r"\s*\S+|\s+", text)


def _argument_pieces(text: str) -> list[str]:
    return [text[i:i + ARGUMENT_FRAGMENT_CHARACTERS] for i in range(0, len(text), ARGUMENT_FRAGMENT_CHARACTERS)] or [""]


def _estimate_prompt_tokens(body: dict) -> int:
    """The prompt's tokens as the stand-in counts (and bills) them: characters / 4, as the harness
    estimates a prompt it has no usage for (times F with the usage-scale=F fault)."""
    from .client import estimate_prompt_tokens

    tokens = max(1, estimate_prompt_tokens(body.get("messages") or [], body.get("tools") or []))
    try:
        _, faults = parse_model(str(body.get("model") or ""))
    except ValueError:
        return tokens
    scale = faults.get("usage-scale")
    return round(tokens * float(scale.value)) if scale is not None and scale.value else tokens


def _cached_of(body: dict, cached: int) -> int:
    """The prompt tokens read from the cache (the cached=N fault): N, at most the whole prompt."""
    return min(max(cached, 0), _estimate_prompt_tokens(body))


def _cached_details(body: dict, cached: int) -> dict:
    """The usage's `prompt_tokens_details` when some of the prompt was cached (as OpenAI sends it)."""
    return {"prompt_tokens_details": {"cached_tokens": _cached_of(body, cached)}} if cached else {}


def _conversation_error(messages: list[dict]) -> str | None:
    """What OpenAI answers 400 to: a tool call left without its `tool` message, or a tool
    message answering no call."""
    pending: list[str] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            if message.get("tool_call_id") not in pending:
                return ("Invalid parameter: messages with role 'tool' must be a response to a preceding message "
                        f"with 'tool_calls' (tool_call_id {message.get('tool_call_id')!r}).")
            pending.remove(message.get("tool_call_id"))
            continue
        if pending:
            return ("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                    f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(pending)}")
        if role == "assistant":
            pending = [call.get("id") for call in message.get("tool_calls") or []]
    if pending:
        return ("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(pending)}")
    return None


@dataclass
class SeenRequest:
    """One request as the server saw it (for tests)."""
    path: str
    model: str
    body: dict
    status: int = 200
    authorization: str = ""  # the Authorization header as sent (which key reached which server)
    # What it billed (StandinServer.billing): the prompt when the model read it (an answer, a 500;
    # not a 429 nor a request refused before), and each completion token it sent.
    billed_prompt_tokens: int = 0
    billed_completion_tokens: int = 0
    billed_cached_tokens: int = 0  # of the prompt tokens, those read from its cache (the cached=N fault)
    # Its handler is done with it: nothing more will be billed (a stream the client left may
    # still bill the token in flight until its next write fails).
    finished: bool = False


class _Aborted(Exception):
    """The stream is abandoned: the client went away, the server stops, or the cut fault."""


class StandinHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streaming, as real servers do
    server: "_StandinHTTPServer"

    def log_message(self, format, *args):
        logger.debug("standin request", extra={"standin_line": format % args})

    # --- plumbing
    def _send_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        record = getattr(self, "record", None)
        if record is not None:
            # Recorded before the client can read the answer: a test that asks what the
            # stand-in saw right after its response must not find the status still unset.
            record.status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str, *, kind: str = "invalid_request_error",
                    param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        self._send_json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers)

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._send_json(200, {"object": "list", "data": [
                {"id": STANDIN_MODEL, "object": "model", "created": 0, "owned_by": "standin"}]})
        elif path.startswith(("/v1/responses/", "/responses/")):
            self._retrieve(path.rsplit("/", 1)[1])
        else:
            self._send_error(404, f"No route {self.path}; this stand-in serves {ROUTES}.")

    def do_POST(self):
        self.record = None  # a kept-alive connection's handler serves many requests
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        responses_api = self.path.rstrip("/") in ("/v1/responses", "/responses")
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions") and not responses_api:
            self._send_error(404, f"No route {self.path}; this stand-in serves {ROUTES}.")
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            self._send_error(400, f"The body is not valid JSON: {exc}")
            return
        record = self.record = self.server.record(SeenRequest(
            self.path, str(body.get("model", "")), body, authorization=self.headers.get("Authorization", "")))
        try:
            record.status = self._respond(body) if responses_api else self._complete(body)
        except (BrokenPipeError, ConnectionResetError, _Aborted):
            self.close_connection = True
            logger.debug("standin stream abandoned", extra={"standin_model": record.model})
        finally:
            record.finished = True

    def _faults_of(self, model: str) -> dict | int:
        """The request's fault modes, or the status of the error it was answered (a model name
        that does not parse, or not the stand-in's)."""
        try:
            base, faults = parse_model(model)
        except ValueError as exc:
            self._send_error(400, str(exc), param="model")
            return 400
        if not base.startswith("standin"):
            self._send_error(404, f"The model {model!r} does not exist here; this stand-in serves {STANDIN_MODEL!r} "
                                  f"(with fault suffixes, e.g. {STANDIN_MODEL}+slow).", code="model_not_found")
            return 404
        return faults

    def _complete(self, body: dict) -> int:
        model = str(body.get("model") or "")
        faults = self._faults_of(model)
        if isinstance(faults, int):
            return faults
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            self._send_error(400, "'messages' must be a non-empty list.", param="messages")
            return 400
        arrival = self.server.arrival(model, messages, body.get("tools"))
        active = {name: fault for name, fault in faults.items()
                  if fault.on_request is None or fault.on_request == arrival}
        if "429" in active:
            self._send_error(429, "Rate limit reached for the stand-in (fault mode 429).", kind="rate_limit_error",
                             headers={"Retry-After": active["429"].value or DEFAULT_RETRY_AFTER_SECONDS})
            return 429
        if "500" in active:
            self.record.billed_prompt_tokens = _estimate_prompt_tokens(body)  # it read the prompt, then failed
            self._send_error(500, "The stand-in failed on purpose (fault mode 500).", kind="server_error")
            return 500
        if "legacy" in active and "max_completion_tokens" in body:
            self._send_error(400, "Unrecognized request argument supplied: max_completion_tokens",
                             param="max_completion_tokens", code="unsupported_parameter")
            return 400
        if "no-stream-options" in active and "stream_options" in body:
            self._send_error(400, "Unrecognized request argument supplied: stream_options",
                             param="stream_options", code="unsupported_parameter")
            return 400
        if "no-tools" in active and body.get("tools"):
            self._send_error(400, f"{model} does not support tools", param="tools", code="unsupported_parameter")
            return 400
        if "context_window" in active and active["context_window"].value:
            window, prompt_tokens = int(float(active["context_window"].value)), _estimate_prompt_tokens(body)
            if prompt_tokens > window:
                self._send_error(400, f"This model's maximum context length is {window} tokens. However, your "
                                      f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
                                      f"messages.", param="messages", code="context_length_exceeded")
                return 400
        problem = _conversation_error(messages)
        if problem:
            self._send_error(400, problem, param="messages")
            return 400

        plan = plan_next(messages, body.get("tools") or [])
        if "unknown-tool" in active:
            offered = {(t.get("function") or {}).get("name") for t in body.get("tools") or []}
            name = "standin_unknown_tool"
            while name in offered:
                name += "_x"
            plan = Plan(tool_calls=[PlannedCall(name, {"reason": "fault mode unknown-tool"})])
        if "bad-json" in active and plan.tool_calls:
            first = plan.tool_calls[0]
            text = first.arguments_text()
            # Cut the closing brace and leave a trailing comma: what a model that lost
            # track of its JSON sends.
            plan.tool_calls[0] = PlannedCall(first.name, text[:-1].rstrip() + ", " if text.endswith("}") else text + "{")

        pace = self.server.token_seconds
        if "slow" in active:
            pace = float(active["slow"].value) if active["slow"].value else SLOW_TOKEN_SECONDS
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        response_id = "chatcmpl-standin-" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
        call_ids = [f"call_{hashlib.sha256(f'{response_id}:{i}'.encode()).hexdigest()[:12]}"
                    for i in range(len(plan.tool_calls))]
        dialect = next((DIALECTS[name] for name in faults if name in DIALECTS), OPENAI)
        if "reasoning" in active and dialect.reasoning_field is None:
            dialect = Dialect(dialect.name, reasoning_field="reasoning_content", **{
                k: getattr(dialect, k) for k in ("whole_calls", "calls_in_one_chunk", "usage", "call_id_prefix",
                                                 "first_content", "role_on_every_delta", "choice_extra", "chunk_extra")})
        if dialect is not OPENAI:
            call_ids = [dialect.call_id_prefix + call_id.removeprefix("call_") for call_id in call_ids]
        if dialect.reasoning_field:
            plan.reasoning = _reasoning_text(plan)
        include_usage = "no-usage" not in active and dialect.usage != "never"
        cached = int(float(active["cached"].value or 0)) if "cached" in active else 0
        if body.get("stream"):
            wants_usage = include_usage and (dialect.usage == "finish"
                                             or bool((body.get("stream_options") or {}).get("include_usage")))
            self._stream(body, plan, call_ids, response_id, cap=cap, pace=pace, cut="cut" in active,
                         include_usage=wants_usage, dialect=dialect, cached=cached)
        else:
            self._answer(body, plan, call_ids, response_id, cap=cap, cut="cut" in active, include_usage=include_usage,
                         dialect=dialect, cached=cached)
        return 200

    def _pieces(self, plan: Plan, call_ids: list[str], cap) -> tuple[list[tuple[str, Any]], str]:
        """The answer as a sequence of (kind, piece) tokens, cut at the token cap (reasoning
        tokens count, as they do on real servers)."""
        pieces: list[tuple[str, Any]] = [("reasoning", p) for p in _content_pieces(plan.reasoning)]
        pieces += [("content", p) for p in _content_pieces(plan.content)]
        for index, (call, call_id) in enumerate(zip(plan.tool_calls, call_ids)):
            pieces.append(("call", (index, call_id, call.name)))
            pieces.extend(("arguments", (index, p)) for p in _argument_pieces(call.arguments_text()))
        finish = "tool_calls" if plan.tool_calls else "stop"
        if isinstance(cap, int) and cap > 0:
            tokens = [i for i, (kind, _) in enumerate(pieces) if kind != "call"]
            if len(tokens) > cap:
                pieces, finish = pieces[:tokens[cap]], "length"
        return pieces, finish

    def _stream(self, body, plan, call_ids, response_id, *, cap, pace, cut, include_usage, dialect=OPENAI,
                cached=0):
        pieces, finish = self._pieces(plan, call_ids, cap)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        created = int(time.time())

        def chunk(delta: dict, finish_reason=None, **extra) -> dict:
            if dialect.role_on_every_delta:
                delta = {"role": "assistant", "content": "", **delta}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, **dict(dialect.choice_extra)}
            return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": body["model"],
                    "choices": [choice], **dict(dialect.chunk_extra), **extra}

        def usage() -> dict:
            completion_tokens = sum(1 for kind, _ in pieces if kind != "call")
            prompt_tokens = _estimate_prompt_tokens(body)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens, **_cached_details(body, cached)}

        self.record.billed_prompt_tokens = _estimate_prompt_tokens(body)
        self.record.billed_cached_tokens = _cached_of(body, cached)
        self._event(chunk({"role": "assistant", "content": dialect.first_content}))
        cut_after = max(1, len(pieces) // 2) if cut else None
        emitted = 0
        # Whole tool calls (ollama, llama.cpp) go out once their arguments are complete.
        whole: dict[int, dict] = {}
        for position, (kind, piece) in enumerate(pieces):
            if cut_after is not None and emitted >= cut_after:
                # Mid-message, no terminating chunk, no [DONE]: the connection just ends.
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                raise _Aborted("cut fault")
            if kind == "reasoning":
                self._event(chunk({dialect.reasoning_field: piece}))
            elif kind == "content":
                self._event(chunk({"content": piece}))
            elif kind == "call":
                index, call_id, name = piece
                if dialect.whole_calls:
                    whole[index] = {"index": index, "id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}
                else:
                    function = {"name": name} if dialect.name == "vllm" else {"name": name, "arguments": ""}
                    self._event(chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                                       "function": function}]}))
                continue  # the name is not a paced token of its own
            else:
                index, text = piece
                if dialect.whole_calls:
                    whole[index]["function"]["arguments"] += text
                    following = pieces[position + 1][0] if position + 1 < len(pieces) else None
                    if following != "arguments" and not dialect.calls_in_one_chunk:
                        self._event(chunk({"tool_calls": [whole.pop(index)]}))
                else:
                    self._event(chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]}))
            emitted += 1
            self.record.billed_completion_tokens += 1
            if pace > 0 and self.server.stopping.wait(pace):
                raise _Aborted("server stopping")
        if whole:  # ollama: every call at once, as its parser gives them after the model's output
            self._event(chunk({"tool_calls": [whole[i] for i in sorted(whole)]}))
        if include_usage and dialect.usage == "finish":
            timings = {"prompt_n": usage()["prompt_tokens"], "predicted_n": usage()["completion_tokens"]}
            self._event(chunk({}, finish, usage=usage(), timings=timings))
        else:
            self._event(chunk({}, finish))
            if include_usage:
                self._event({"id": response_id, "object": "chat.completion.chunk", "created": created,
                             "model": body["model"], "choices": [], **dict(dialect.chunk_extra), "usage": usage()})
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")  # the terminating zero-length chunk

    def _event(self, payload: dict) -> None:
        self._write_chunk(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()  # chunk by chunk: the client sees each token as it is made

    def _answer(self, body, plan, call_ids, response_id, *, cap, cut, include_usage, dialect=OPENAI, cached=0):
        pieces, finish = self._pieces(plan, call_ids, cap)
        self.record.billed_prompt_tokens = _estimate_prompt_tokens(body)
        self.record.billed_cached_tokens = _cached_of(body, cached)
        self.record.billed_completion_tokens = sum(1 for kind, _ in pieces if kind != "call")
        content = "".join(p for kind, p in pieces if kind == "content")
        reasoning = "".join(p for kind, p in pieces if kind == "reasoning")
        calls: dict[int, dict] = {}
        for kind, piece in pieces:
            if kind == "call":
                index, call_id, name = piece
                calls[index] = {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
            elif kind == "arguments":
                index, text = piece
                calls[index]["function"]["arguments"] += text
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message[dialect.reasoning_field] = reasoning
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        payload: dict[str, Any] = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                                   "model": body["model"],
                                   "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
        if include_usage:
            completion_tokens = sum(1 for kind, _ in pieces if kind != "call")
            prompt_tokens = _estimate_prompt_tokens(body)
            payload["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens, **_cached_details(body, cached)}
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if cut:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            raise _Aborted("cut fault")
        self.wfile.write(data)


    # --- the Responses API, background mode (orchestrator/llm/responses.py is the client's side)
    def _respond(self, body: dict) -> int:
        """POST /v1/responses with `background` and `stream`: the whole answer is made at once
        and kept (billed in full, whatever happens to the connection, as a background response
        is), then streamed as events at the server's pace; GET /v1/responses/{id} gives it
        back, `in_progress` until its stream would have ended."""
        model = str(body.get("model") or "")
        faults = self._faults_of(model)
        if isinstance(faults, int):
            return faults
        if not body.get("background") or not body.get("stream"):
            self._send_error(400, "This stand-in serves the Responses API in background mode only: send "
                                  "background: true and stream: true.", param="background")
            return 400
        messages, tools = chat_of_responses_input(body)
        if not messages:
            self._send_error(400, "'input' must be a non-empty list.", param="input")
            return 400
        chat_body = {"model": model, "messages": messages, "tools": tools}
        active = {name: fault for name, fault in faults.items()
                  if fault.on_request is None or fault.on_request == self.server.arrival(model, messages, tools)}
        if "429" in active:
            self._send_error(429, "Rate limit reached for the stand-in (fault mode 429).", kind="rate_limit_error",
                             headers={"Retry-After": active["429"].value or DEFAULT_RETRY_AFTER_SECONDS})
            return 429
        problem = _conversation_error(messages)
        if problem:
            self._send_error(400, problem, param="input")
            return 400
        plan = plan_next(messages, tools)
        pace = self.server.token_seconds
        if "slow" in active:
            pace = float(active["slow"].value) if active["slow"].value else SLOW_TOKEN_SECONDS
        response_id = f"resp_standin_{hashlib.sha256(f'{time.time_ns()}:{id(self)}'.encode()).hexdigest()[:20]}"
        call_ids = [f"call_{hashlib.sha256(f'{response_id}:{i}'.encode()).hexdigest()[:12]}"
                    for i in range(len(plan.tool_calls))]
        pieces, finish = self._pieces(plan, call_ids, body.get("max_output_tokens"))
        tokens = sum(1 for kind, _ in pieces if kind != "call")
        kept = StoredResponse(response_id, model, created=time.time(), done_at=time.monotonic() + pace * tokens,
                              output=_response_output(pieces), finish=finish,
                              usage={"input_tokens": _estimate_prompt_tokens(chat_body), "output_tokens": tokens})
        self.server.keep(kept)
        self.record.billed_prompt_tokens = kept.usage["input_tokens"]
        self.record.billed_completion_tokens = tokens

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sequence = iter(range(1_000_000))

        def event(kind: str, **payload) -> None:
            data = json.dumps({"type": kind, "sequence_number": next(sequence), **payload}, ensure_ascii=False)
            self._write_chunk(f"event: {kind}\ndata: {data}\n\n".encode())

        event("response.created", response=kept.as_json(in_progress=True))
        message_open = False
        for kind, piece in pieces:
            if kind == "content":
                if not message_open:
                    event("response.output_item.added", output_index=0, item={
                        "type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "in_progress",
                        "content": []})
                    message_open = True
                event("response.output_text.delta", item_id=f"msg_{response_id}", output_index=0, content_index=0,
                      delta=piece, logprobs=[])
            elif kind == "call":
                index, call_id, name = piece
                event("response.output_item.added", output_index=index + 1, item={
                    "type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
                    "arguments": "", "status": "in_progress"})
                continue
            elif kind == "arguments":
                index, text = piece
                event("response.function_call_arguments.delta", item_id=f"fc_{call_ids[index]}",
                      output_index=index + 1, delta=text)
            else:
                continue  # no reasoning items in this shape
            if pace > 0 and self.server.stopping.wait(pace):
                raise _Aborted("server stopping")
        done = "response.completed" if finish != "length" else "response.incomplete"
        event(done, response=kept.as_json())
        self._write_chunk(b"")
        return 200

    def _retrieve(self, response_id: str) -> None:
        kept = self.server.kept(response_id)
        self.record = self.server.record(SeenRequest(self.path, kept.model if kept else "", {}))
        if kept is None:
            self._send_error(404, f"No response found with id '{response_id}'.", code="not_found")
            return
        self._send_json(200, kept.as_json(in_progress=time.monotonic() < kept.done_at))


@dataclass
class StoredResponse:
    """A background response the stand-in keeps (what GET /v1/responses/{id} answers)."""
    id: str
    model: str
    created: float
    done_at: float  # monotonic: when its stream would have ended, whoever still listens
    output: list[dict]
    finish: str
    usage: dict

    def as_json(self, *, in_progress: bool = False) -> dict:
        status = "in_progress" if in_progress else ("incomplete" if self.finish == "length" else "completed")
        return {"id": self.id, "object": "response", "created_at": int(self.created), "model": self.model,
                "background": True, "status": status, "output": [] if in_progress else self.output,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": None if in_progress else {
                    **self.usage, "total_tokens": self.usage["input_tokens"] + self.usage["output_tokens"],
                    "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


def _response_output(pieces: list[tuple[str, Any]]) -> list[dict]:
    """The finished response's output items: the message, then each function call."""
    text = "".join(p for kind, p in pieces if kind == "content")
    output: list[dict] = []
    if text:
        output.append({"type": "message", "id": "msg_0", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    calls: dict[int, dict] = {}
    for kind, piece in pieces:
        if kind == "call":
            index, call_id, name = piece
            calls[index] = {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
                            "arguments": "", "status": "completed"}
        elif kind == "arguments":
            index, text = piece
            calls[index]["arguments"] += text
    return output + [calls[i] for i in sorted(calls)]


def chat_of_responses_input(body: dict) -> tuple[list[dict], list[dict]]:
    """A Responses request's instructions and input items as the Chat Completions messages and
    tools the planner reads (the inverse of orchestrator/llm/responses.py's translation)."""
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in body.get("input") or []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type") or "message"
        if kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append({"id": item.get("call_id", ""), "type": "function", "function": {
                "name": item.get("name", ""), "arguments": item.get("arguments", "")}})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": item.get("output", "")})
        else:
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            messages.append({"role": item.get("role", "user"), "content": content})
    tools = [{"type": "function", "function": {"name": t.get("name", ""), "description": t.get("description", ""),
                                               "parameters": t.get("parameters") or {}}}
             for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
    return messages, tools


class _StandinHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stream still open does not hold up stopping
    allow_reuse_address = True

    def __init__(self, address, token_seconds: float):
        super().__init__(address, StandinHandler)
        self.token_seconds = token_seconds
        self.stopping = threading.Event()
        self.requests: list[SeenRequest] = []
        self._arrivals: dict[str, int] = {}
        self._responses: dict[str, StoredResponse] = {}  # background responses, by id
        self._lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up (a cancelled stream, a closed keep-alive connection) is
        # ordinary here, not worth a traceback on stderr.
        logger.debug("standin connection error", exc_info=True, extra={"standin_client": str(client_address)})

    def record(self, request: SeenRequest) -> SeenRequest:
        with self._lock:
            self.requests.append(request)
        return request

    def keep(self, response: StoredResponse) -> None:
        with self._lock:
            self._responses[response.id] = response

    def kept(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._responses.get(response_id)

    def arrival(self, model: str, messages: list, tools) -> int:
        """How many times this same request has arrived (1 the first time): what `FAULT@N` counts."""
        key = hashlib.sha256(json.dumps([model, messages, tools], sort_keys=True, default=str).encode()).hexdigest()
        with self._lock:
            self._arrivals[key] = self._arrivals.get(key, 0) + 1
            return self._arrivals[key]


class StandinServer:
    """The stand-in on a port (0: a free one), served from a background thread by `start()`
    or in the foreground by `serve_forever()`.

        with StandinServer(token_seconds=0.001) as server:
            LLMClient(base_url=server.base_url, api_key="standin", model=STANDIN_MODEL)
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token_seconds: float = DEFAULT_TOKEN_SECONDS):
        self._httpd = _StandinHTTPServer((host, port), token_seconds)
        self.host, self.port = self._httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def requests(self) -> list[SeenRequest]:
        """The requests received so far, oldest first."""
        with self._httpd._lock:
            return list(self._httpd.requests)

    def response_text(self, response_id: str) -> str | None:
        """The text of a background response it keeps (None: it has no such response)."""
        kept = self._httpd.kept(response_id)
        if kept is None:
            return None
        return "".join(part["text"] for item in kept.output if item["type"] == "message" for part in item["content"])

    @property
    def billing(self) -> list[dict]:
        """What the stand-in billed, request by request: {model, status, prompt_tokens, completion_tokens,
        cached_tokens} (cached_tokens: of the prompt tokens, those read from its cache)."""
        return [{"model": r.model, "status": r.status, "prompt_tokens": r.billed_prompt_tokens,
                 "completion_tokens": r.billed_completion_tokens, "cached_tokens": r.billed_cached_tokens}
                for r in self.requests]

    @property
    def token_seconds(self) -> float:
        return self._httpd.token_seconds

    @token_seconds.setter
    def token_seconds(self, value: float) -> None:
        self._httpd.token_seconds = value

    def start(self) -> "StandinServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"standin-llm:{self.port}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
        self._httpd.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "StandinServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
