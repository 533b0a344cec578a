"""Extraction over the shipped sample contracts (pure functions; no database, no Django).

Expected values were written by hand from the sample texts.
"""
import pytest

from demo.tasktypes.contract_extraction import SAMPLES_DIR, extract, list_samples


def usd(v):
    return {"currency": "USD", "value": v}


def eur(v):
    return {"currency": "EUR", "value": v}


def gbp(v):
    return {"currency": "GBP", "value": v}


EXPECTED = {
    # 'between X ("the Client") and Y ("the Provider")'; ISO, "Month D, YYYY" and "D Month YYYY" dates.
    "contract_01.txt": {
        "parties": ["Acme Logistics GmbH", "Northwind Freight Ltd."],
        "dates": ["2025-01-05", "2025-02-01", "2026-01-31"],
        "amounts": [eur("12500.00"), eur("18.50"), eur("150000.00")],
    },
    # 'made by and between X and Y.' (sentence-final period dropped); US date; duplicate date removed.
    "contract_02.txt": {
        "parties": ["Orion Analytics LLC", "Maria T. Alvarez"],
        "dates": ["2024-03-05", "2027-03-05"],
        "amounts": [usd("50000.00")],
    },
    # 'Landlord: X, address' / 'Tenant: X and Y' lines; "the 1st day of July, 2024".
    "contract_03.txt": {
        "parties": ["Harold J. Whitmore", "Priya Nair", "Arjun Nair"],
        "dates": ["2024-07-01", "2025-06-30", "2025-05-01"],
        "amounts": [usd("1850.00"), usd("75.00"), usd("3700.00")],
    },
    # BETWEEN: (1) ... (2) ... block; DD.MM.YYYY; "1,200 cubic metres" is not an amount.
    "contract_04.txt": {
        "parties": ["Baltic Timber Supply AB", "Greenfield Construction plc"],
        "dates": ["2024-03-15", "2024-04-01", "2025-03-31"],
        "amounts": [eur("48000.00"), eur("2400.50"), gbp("40000.00")],
    },
    # 'X, a Delaware corporation (the "Company"), and Y, an individual ... ("Consultant")'; "Sept. 30, 2025".
    "contract_05.txt": {
        "parties": ["Brightline Software Inc.", "Daniel O'Connor"],
        "dates": ["2024-10-01", "2025-09-30"],
        "amounts": [usd("150.00"), usd("24000.00"), usd("2500.00")],
    },
    # Three parties incl. "Bank of Nova Terra plc"; only GBP.
    "contract_07.txt": {
        "parties": ["Sunrise Bakery Ltd", "Bank of Nova Terra plc", "Thomas A. Reid"],
        "dates": ["2025-02-01", "2025-03-01", "2035-03-01"],
        "amounts": [gbp("250000.00"), gbp("2315.40"), gbp("2500.00"), gbp("100000.00")],
    },
    # "1,000,000 USD" (currency after the number).
    "contract_08.txt": {
        "parties": ["Cascade Equipment Rentals Inc.", "Riverbend Farms LLC"],
        "dates": ["2024-04-01", "2026-03-31", "2026-01-31"],
        "amounts": [usd("3000.00"), usd("9000.00"), usd("1000000.00"), usd("185000.00")],
    },
    # "$2 million"; "(the "Premises")" is not a party.
    "contract_12.txt": {
        "parties": ["Granite Tower Holdings LLC", "Pinecrest Legal Services PC"],
        "dates": ["2024-08-01", "2029-07-31", "2024-09-01"],
        "amounts": [usd("14250.00"), usd("42750.00"), usd("2000000.00")],
    },
    # 'Party A/B/C:' lines with a title; "(the "JV Company")" is not a party; mixed currencies.
    "contract_16.txt": {
        "parties": ["Lumen Energy Partners LLC", "Okafor Holdings Ltd", "Dr. Amara Okafor"],
        "dates": ["2025-04-01", "2025-04-15", "2028-03-31"],
        "amounts": [gbp("75000.00"), eur("250000.00"), eur("120000.00")],
    },
    # 'by and among X ("Sponsor"), Y ("Team") and Z ("Rider")'.
    "contract_20.txt": {
        "parties": ["Velocity Sports Drinks Inc.", "Northern Lights Cycling Team", "Emma J. Hart"],
        "dates": ["2025-03-01", "2026-02-28"],
        "amounts": [usd("120000.00"), usd("10000.00"), usd("25000.00"), eur("2500.00")],
    },
}


@pytest.mark.parametrize("filename", sorted(EXPECTED))
def test_exact_extraction(filename):
    text = (SAMPLES_DIR / filename).read_text(encoding="utf-8")
    assert extract(text) == EXPECTED[filename]


def test_list_samples_is_sorted_and_complete():
    samples = list_samples()
    assert [p.name for p in samples] == [f"contract_{i:02d}.txt" for i in range(1, 21)]


@pytest.mark.parametrize("path", list_samples(), ids=lambda p: p.name)
def test_every_sample_yields_parties_dates_and_amounts(path):
    result = extract(path.read_text(encoding="utf-8"))
    assert len(result["parties"]) >= 2
    assert len(result["dates"]) >= 1
    assert len(result["amounts"]) >= 1
    assert all(len(d) == 10 and d[4] == d[7] == "-" for d in result["dates"])
    for amount in result["amounts"]:
        assert amount["currency"] in {"USD", "EUR", "GBP"}
        whole, _, cents = amount["value"].partition(".")
        assert whole.isdigit() and len(cents) == 2 and cents.isdigit()


def test_rules_on_small_texts():
    result = extract(
        "This NDA is made between Acme Inc. and Jane Doe. Support is available between Monday and "
        "Friday. Fees: $2.5 million, 5,000 euros, US$1,000 and 300 pounds sterling; 1,200 units. "
        "Dates: 31/02/2024 (invalid), 29 February 2024, Jan 3 2025 and 2024-02-29 again."
    )
    assert result == {
        "parties": ["Acme Inc.", "Jane Doe"],
        "dates": ["2024-02-29", "2025-01-03"],
        "amounts": [usd("2500000.00"), eur("5000.00"), usd("1000.00"), gbp("300.00")],
    }
