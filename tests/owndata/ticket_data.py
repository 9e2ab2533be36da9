"""Own-data test input: a support-ticket file with declared secrets (emails, account numbers) and
customers with several tickets, as a user of `scpdr train --secrets-field --group-field` has."""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = (
    "Customer {name} wrote in: please update the email on my account to {email}; my account "
    "number is {account}.",
    "Ticket: {name} reports a double charge on account {account}. Reply to {email} once it is "
    "refunded.",
    "{name} cannot log in. Registered email {email}, account {account}; reset link never arrived.",
)


def tickets(n: int, *, seed: int = 0, customers: int | None = None) -> list[dict]:
    """``n`` tickets of ``customers`` customers (default n // 2): each customer has one email and
    one account number, its tickets repeat them; ``secrets`` lists both."""
    from faker import Faker

    fk = Faker("en_US")
    fk.seed_instance(seed)
    rng = random.Random(seed)
    people = []
    for c in range(customers or max(1, n // 2)):
        name = fk.name()
        people.append(
            {
                "customer": f"cust-{c:04d}",
                "name": name,
                "email": fk.unique.email(),
                "account": f"{rng.randrange(10**9, 10**10)}",
            }
        )
    rows = []
    for i in range(n):
        p = people[i % len(people)] if i < len(people) else rng.choice(people)
        text = TEMPLATES[i % len(TEMPLATES)].format(**p)
        rows.append(
            {
                "id": f"t{i:04d}",
                "customer": p["customer"],
                "text": text,
                "secrets": [p["email"], p["account"]],
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
