"""Where a SlicePlacementGroup borrows slice heads: the lenders open in this process (a SliceClaim, see
tpuray.slices.claim) and the loans they give. Kept apart from both so that neither imports the other."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

OPEN: list[Lender] = []  # open lenders, oldest first
LOCK = threading.Lock()  # guards OPEN and every lender's books


class Lender(Protocol):
    def lend(self, pod_type: str, count: int) -> Loan | None:
        """`count` heads of `pod_type` marked lent, or None (called with LOCK held)."""
        ...

    def returned(self, loan: Loan) -> None:
        """The borrower is shut down: the loan's heads may be lent again."""
        ...

    def placed(self, loan: Loan) -> None:
        """The borrower's chips are reserved."""
        ...


@dataclass
class Loan:
    """Heads a SlicePlacementGroup holds in place of its own: their bundle indices in the lender's
    placement group, their slices' names and their head nodes' resources."""

    lender: Lender
    indices: list[int]
    names: list[str]
    resources: list[dict[str, float]]
    term: int = 0  # the lender's opening it was lent in: a loan of an earlier one changes nothing

    def give_back(self) -> None:
        self.lender.returned(self)

    def placed(self) -> None:
        self.lender.placed(self)


def lend(pod_type: str, count: int) -> Loan | None:
    """`count` heads of `pod_type` from the first open lender that has them; None: reserve your own."""
    with LOCK:
        for lender in OPEN:
            loan = lender.lend(pod_type, count)
            if loan is not None:
                return loan
    return None
