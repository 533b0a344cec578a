"""Deterministic, rule-based extraction of parties, dates and money amounts from the
sample contracts shipped in ``contract_samples/`` (the ``demo.contracts`` task type).

Pure functions, no Django: ``extract(text)`` and ``list_samples()``.

Rules (all results in order of first appearance, duplicates removed):

Parties are recognised only where a contract introduces them:
  * a name followed by a defined role term, optionally after a short descriptor:
    ``Acme GmbH ("the Client")``, ``X (the "Tenant")``, ``X (hereinafter referred to as
    "the Seller")``, ``X, a Delaware corporation (the "Company")``. Only role terms in
    ``ROLE_TERMS`` count, so ``(the "Premises")`` or ``(the "Agreement")`` do not;
  * ``made|entered into|concluded|executed|dated ... [by and] between|among X and Y``,
    optionally with a descriptor after X (``X, a company registered in ..., and Y``);
  * labelled lines ``Party A: X``, ``Landlord: X``, ``TENANT: X and Y`` (labels in
    ``LINE_LABELS``, case-insensitive);
  * numbered items under a ``BETWEEN:`` / ``PARTIES`` heading: ``(1) X, ...``, ``1. X ...``.
  A name is a run of capitalised words (plus ``&`` and a few lowercase particles such as
  ``of`` and ``plc``) separated by single spaces; it ends after a word with a trailing
  period (``Inc.``, ``Ltd.``, ``Doe.``) unless that word is an initial (``R.``) or a title
  (``Dr.``). The period is kept for abbreviations (``Inc.``, ``Ltd.``, ``S.A.``) and
  dropped otherwise (sentence end).

Dates: ``January 5, 2025`` / ``Jan. 5 2025`` / ``November 1st, 2025``, ``5 March 2024`` /
  ``1st March 2024`` / ``the 1st day of July, 2024``, ISO ``2024-07-01``, US slashes
  ``01/15/2025`` (month first) and European dots ``15.03.2024`` (day first). Returned as
  ISO ``YYYY-MM-DD``; impossible dates are skipped. Month names are case-sensitive.

Amounts: a currency marker (``$``, ``US$``, ``USD``, ``€``, ``EUR``, ``£``, ``GBP``) before
  the number, or a currency word after it (``USD``, ``EUR``, ``GBP``, ``dollars``,
  ``US dollars``, ``euros``, ``pounds sterling``); numbers use ``,`` for thousands and
  ``.`` for decimals, optionally followed by ``million`` / ``thousand``. Returned as
  ``{"currency": "USD", "value": "12500.00"}``; bare numbers are never amounts.
"""
from __future__ import annotations

import datetime as _dt
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

SAMPLES_DIR = Path(__file__).resolve().parent / "contract_samples"

# --------------------------------------------------------------------------- parties

ROLE_TERMS = (
    "Client", "Service Provider", "Provider", "Supplier", "Customer", "Buyer", "Purchaser",
    "Seller", "Vendor", "Lender", "Borrower", "Guarantor", "Licensor", "Licensee", "Landlord",
    "Tenant", "Lessor", "Lessee", "Consultant", "Contractor", "Company", "Employer",
    "Employee", "Distributor", "Developer", "Sponsor", "Team", "Rider", "Athlete",
    "Disclosing Party", "Receiving Party", "Investor", "Agent", "Principal", "Partner",
    "Party A", "Party B", "Party C",
)

LINE_LABELS = (
    r"Party\s+[A-C1-3]", "Landlord", "Tenant", "Lessor", "Lessee", "Licensor", "Licensee",
    "Lender", "Borrower", "Client", "Customer", "Provider", "Service Provider", "Supplier",
    "Buyer", "Seller", "Developer", "Consultant", "Contractor", "Company", "Employer",
    "Employee", "Guarantor", "Sponsor",
)

_PARTICLES = ("of", "de", "del", "der", "van", "von", "du", "la", "plc")
_STOP_WORDS = ("AND", "BETWEEN", "AMONG", "BY", "WHEREAS", "THIS", "THE")
_TITLES = {"Dr.", "Mr.", "Mrs.", "Ms.", "Prof.", "Sir."}
_ABBREVIATIONS = {"Inc", "Ltd", "Co", "Corp", "Bros", "Ltda", "Pty", "Plc", "Cie", "Jr", "Sr"}

_WORD = (r"(?:(?!(?:%s)\b)[A-Z][A-Za-z0-9'&.\-]*|&|(?:%s)\b)"
         % ("|".join(_STOP_WORDS), "|".join(_PARTICLES)))
# The first word must be capitalised; the following ones are separated by one space.
_NAME = r"(?!(?:%s)\b)[A-Z][A-Za-z0-9'&.\-]*(?: %s)*" % ("|".join(_STOP_WORDS), _WORD)

_ROLE = "|".join(re.escape(r).replace(r"\ ", r"\s+") for r in sorted(ROLE_TERMS, key=len, reverse=True))
_QUOTE_OPEN, _QUOTE_CLOSE = "[\"\u201c]", "[\"\u201d]"
_ROLE_PAREN = (r"\(\s*(?:hereinafter\s+(?:referred\s+to\s+as\s+|called\s+)?)?(?:the\s+)?"
               rf"{_QUOTE_OPEN}(?:the\s+)?(?:{_ROLE}){_QUOTE_CLOSE}\s*\)")
_DESCRIPTOR_START = r"(?:an?|the|registered|incorporated|residing|whose|with|having)\b"
# A descriptor never contains parentheses, quotes, ';' or ', and ' (which would start the next party).
_DESCRIPTOR = r"(?:(?!,\s+and\s)[^()\";\u201c\u201d])*?"

_DEFINED_PARTY_RE = re.compile(rf"(?P<name>{_NAME})(?:,\s+{_DESCRIPTOR_START}{_DESCRIPTOR})?\s*{_ROLE_PAREN}")

_BETWEEN_RE = re.compile(
    rf"\b(?:made|entered\s+into|concluded|executed|dated)\b[^;]{{0,80}}?\b(?:by\s+and\s+)?(?:between|among)\s+"
    rf"(?P<first>{_NAME})(?:,\s+{_DESCRIPTOR_START}{_DESCRIPTOR},)?\s+and\s+(?P<second>{_NAME})"
)

_LABEL_RE = re.compile(
    rf"^[ \t]*(?i:{'|'.join(LINE_LABELS)})[ \t]*:[ \t]*(?P<first>{_NAME})(?:[ \t]+and[ \t]+(?P<second>{_NAME}))?",
    re.MULTILINE,
)

_PARTIES_HEADING_RE = re.compile(r"^[ \t]*(?:BETWEEN|PARTIES|THE PARTIES|Parties|Between)[ \t]*:?[ \t]*$", re.MULTILINE)
_NUMBERED_PARTY_RE = re.compile(rf"^[ \t]*(?:\(\d\)|\d\.|\([a-c]\)|\([ivx]+\))[ \t]+(?P<name>{_NAME})")


def _split_name(raw: str) -> list[str]:
    """Split a run of capitalised words into names: a word with a trailing period ends a
    name unless it is an initial or a title."""
    pieces, current = [], []
    for word in raw.split(" "):
        current.append(word)
        if word.endswith(".") and not re.fullmatch(r"[A-Z]\.", word) and word not in _TITLES:
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    return [" ".join(p) for p in pieces]


def _tidy_name(name: str) -> str:
    words = name.split(" ")
    while words and (words[-1] in _PARTICLES and words[-1] != "plc" or words[-1] == "&"):
        words.pop()
    if words:
        last = words[-1]
        if last.endswith(".") and last.count(".") == 1 and last[:-1] not in _ABBREVIATIONS \
                and not re.fullmatch(r"[A-Z]\.", last) and last not in _TITLES:
            words[-1] = last[:-1]
    return " ".join(words).strip()


def _name_at(raw: str, start: int, *, keep: str) -> tuple[int, str]:
    """(position, cleaned name) from a raw name match; keep the first or last piece."""
    pieces = _split_name(raw)
    if keep == "first":
        return start, _tidy_name(pieces[0])
    offset = raw.rfind(pieces[-1])
    return start + offset, _tidy_name(pieces[-1])


def _numbered_block_parties(text: str) -> list[tuple[int, str]]:
    found = []
    for heading in _PARTIES_HEADING_RE.finditer(text):
        pos = heading.end() + 1
        seen_any, last_continues = False, True
        for line in text[pos:].splitlines(keepends=True):
            line_start, pos = pos, pos + len(line)
            stripped = line.strip()
            if not stripped:
                if seen_any and not last_continues:
                    break
                continue
            m = _NUMBERED_PARTY_RE.match(line)
            if m:
                found.append(_name_at(m.group("name"), line_start + m.start("name"), keep="first"))
                seen_any = True
            elif stripped.lower() in ("and", "and:"):
                pass
            elif not line[:1].isspace():
                break  # neither a party item, a continuation line nor "and": the block is over
            last_continues = stripped.endswith((";", "and", "AND", ","))
    return found


def extract_parties(text: str) -> list[str]:
    found: list[tuple[int, str]] = []
    for m in _DEFINED_PARTY_RE.finditer(text):
        found.append(_name_at(m.group("name"), m.start("name"), keep="last"))
    for m in _BETWEEN_RE.finditer(text):
        found.append(_name_at(m.group("first"), m.start("first"), keep="last"))
        found.append(_name_at(m.group("second"), m.start("second"), keep="first"))
    for m in _LABEL_RE.finditer(text):
        for group in ("first", "second"):
            if m.group(group):
                found.append(_name_at(m.group(group), m.start(group), keep="first"))
    found.extend(_numbered_block_parties(text))
    return _unique(name for _, name in sorted(found, key=lambda item: item[0]) if name)


# ----------------------------------------------------------------------------- dates

_MONTHS = {
    "January": 1, "February": 2, "March": 3, "April": 4, "May": 5, "June": 6, "July": 7,
    "August": 8, "September": 9, "October": 10, "November": 11, "December": 12,
    "Jan": 1, "Feb": 2, "Mar": 3, "Apr": 4, "Jun": 6, "Jul": 7, "Aug": 8, "Sep": 9,
    "Sept": 9, "Oct": 10, "Nov": 11, "Dec": 12,
}
_MON = r"(?:%s)\b\.?" % "|".join(sorted(_MONTHS, key=len, reverse=True))
_ORD = r"(?:st|nd|rd|th)?"

_DATE_RE = re.compile(
    rf"(?<![\w/.\-])(?:"
    rf"(?P<a_mon>{_MON})\s+(?P<a_day>\d{{1,2}}){_ORD},?\s+(?P<a_year>\d{{4}})"
    rf"|(?P<b_day>\d{{1,2}}){_ORD}\s+(?:day\s+of\s+)?(?P<b_mon>{_MON}),?\s+(?P<b_year>\d{{4}})"
    rf"|(?P<iso_y>\d{{4}})-(?P<iso_m>\d{{2}})-(?P<iso_d>\d{{2}})"
    rf"|(?P<us_m>\d{{1,2}})/(?P<us_d>\d{{1,2}})/(?P<us_y>\d{{4}})"
    rf"|(?P<eu_d>\d{{1,2}})\.(?P<eu_m>\d{{1,2}})\.(?P<eu_y>\d{{4}})"
    rf")(?![\d/\-]|\.\d)"
)


def _month(token: str) -> int:
    return _MONTHS[token.rstrip(".")]


def extract_dates(text: str, *, ambiguous: list | None = None) -> list[str]:
    """ISO dates found in `text`. With `ambiguous` (the strict extractor), an all-numeric date
    whose day and month could be swapped (10/01/2024) is not guessed: it goes there instead."""
    dates = []
    for m in _DATE_RE.finditer(text):
        g = m.groupdict()
        if g["a_mon"]:
            y, mo, d = int(g["a_year"]), _month(g["a_mon"]), int(g["a_day"])
        elif g["b_mon"]:
            y, mo, d = int(g["b_year"]), _month(g["b_mon"]), int(g["b_day"])
        elif g["iso_y"]:
            y, mo, d = int(g["iso_y"]), int(g["iso_m"]), int(g["iso_d"])
        elif g["us_y"]:
            y, mo, d = int(g["us_y"]), int(g["us_m"]), int(g["us_d"])
        else:
            y, mo, d = int(g["eu_y"]), int(g["eu_m"]), int(g["eu_d"])
        if ambiguous is not None and (g["us_y"] or g["eu_y"]) and mo <= 12 and d <= 12 and mo != d:
            ambiguous.append(f"date {m.group(0)}: day and month order unknown")
            continue
        try:
            dates.append(_dt.date(y, mo, d).isoformat())
        except ValueError:
            continue
    return _unique(dates)


# --------------------------------------------------------------------------- amounts

_PREFIX_CURRENCY = {"US$": "USD", "$": "USD", "USD": "USD", "€": "EUR", "EUR": "EUR", "£": "GBP", "GBP": "GBP"}
_SUFFIX_CURRENCY = {"usd": "USD", "eur": "EUR", "gbp": "GBP", "us dollars": "USD", "dollars": "USD",
                    "euros": "EUR", "euro": "EUR", "pounds sterling": "GBP"}
_MULTIPLIERS = {"million": Decimal(1_000_000), "thousand": Decimal(1_000)}
_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"

_AMOUNT_RE = re.compile(
    rf"(?:(?<![A-Za-z])(?P<pre>US\$|USD|EUR|GBP|\$|€|£)[ \t]?(?P<pre_num>{_NUMBER})(?![\d,]\d)"
    rf"(?:\s+(?P<pre_mult>million|thousand)\b)?"
    rf"|(?<![\d,.])(?P<suf_num>{_NUMBER})(?:\s+(?P<suf_mult>million|thousand))?"
    rf"\s+(?P<suf>USD|EUR|GBP|US dollars|dollars|euros|euro|pounds sterling)\b)"
)


def extract_amounts(text: str) -> list[dict]:
    amounts = []
    for m in _AMOUNT_RE.finditer(text):
        if m.group("pre"):
            currency, number, mult = _PREFIX_CURRENCY[m.group("pre")], m.group("pre_num"), m.group("pre_mult")
        else:
            currency, number, mult = _SUFFIX_CURRENCY[m.group("suf").lower()], m.group("suf_num"), m.group("suf_mult")
        value = Decimal(number.replace(",", "")) * _MULTIPLIERS.get(mult or "", Decimal(1))
        amounts.append((currency, str(value.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))))
    return [{"currency": c, "value": v} for c, v in _unique(amounts)]


# ------------------------------------------------------------------------------ api

def _unique(items) -> list:
    seen, out = set(), []
    for item in items:
        key = item.casefold() if isinstance(item, str) else item
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


EXTRACTORS = ("default", "strict")


def extract(text: str, extractor: str = "default") -> dict:
    """Parties, ISO dates and amounts found in a contract text (see module docstring).

    The strict extractor guesses nothing: an all-numeric date that reads two ways is listed
    under `ambiguous` (for a person to settle) instead of being read month-first or day-first."""
    if extractor not in EXTRACTORS:
        raise ValueError(f"unknown extractor {extractor!r}; use one of {', '.join(EXTRACTORS)}")
    ambiguous: list[str] | None = [] if extractor == "strict" else None
    found = {
        "parties": extract_parties(text),
        "dates": extract_dates(text, ambiguous=ambiguous),
        "amounts": extract_amounts(text),
    }
    if ambiguous is not None:
        found["ambiguous"] = _unique(ambiguous)
    return found


class MalformedContract(ValueError):
    """A contract the extractor cannot read: not UTF-8 text, or no parties in it."""


def read_contract(path: Path, extractor: str = "default") -> dict:
    """Extract one contract file; raise MalformedContract when it is not a readable contract."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedContract(f"{path.name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    found = extract(text, extractor)
    if not found["parties"]:
        raise MalformedContract(f"{path.name}: no parties found (expected a 'between X and Y' clause or a "
                                f"numbered list of parties)")
    return found


def list_samples() -> list[Path]:
    """The contracts to process, sorted by file name: the shipped samples, or those in
    ORCH_CONTRACTS_DIR when it is set."""
    from django.conf import settings

    directory = Path(settings.ORCH_CONTRACTS_DIR or SAMPLES_DIR)
    return sorted(directory.glob("contract_*.txt"))
