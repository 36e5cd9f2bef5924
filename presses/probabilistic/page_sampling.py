"""Pages as the sampling unit of probabilistic eviction (one job: the page unit's math).

Probabilistic eviction (paper 003) draws ``m`` prompt entries with replacement from a proposal ``pi``,
keeps the entries drawn at least once and corrects decoding by self-normalised importance sampling
(SNIS; Algorithm 1, eq. 10). Nothing in the estimator needs the entry to be a single token. With the
page unit, page ``p`` holds the positions ``[p B, (p + 1) B)`` (``B = page_size``; the last page may
be partial, as in :mod:`presses.core.paging`), the pages are drawn with replacement from a page proposal,
and every token of a drawn page is kept. This module gives the pieces that differ from the token
unit: the page proposal (:func:`page_proposal`), the budget target and tolerance in pages
(:func:`page_target`, :func:`page_tolerance`) and the expansion of per-page counts and probabilities
back to tokens (:func:`expand_pages`), from which :func:`presses.probabilistic.correction.snis_bias` builds the
per-token bias unchanged.

Why the page estimator is consistent (paper 003 section 5: Definition 4, eq. 9, Algorithm 1, eq. 10;
appendix C, eqs. 12-15). Take one query and one KV group. Write ``a_i = exp(s q . k_i)`` for the prompt
entries ``i <= t`` and let ``R_a``, ``R_v`` be the (exact) contributions of the entries written after
eviction, so the full attention output is ``o = (N + R_v) / (A + R_a)`` with ``N = sum_i a_i v_i`` and
``A = sum_i a_i``. Group the sums by page: ``N = sum_p N_p``, ``A = sum_p A_p`` with
``N_p = sum_{i in p} a_i v_i`` and ``A_p = sum_{i in p} a_i``. Draw ``m`` pages i.i.d. from ``pi_p`` and let ``c_p`` be
the counts, so ``E[c_p] = m pi_p``. Then

    N_hat = sum_p c_p / (m pi_p) * N_p,        A_hat = sum_p c_p / (m pi_p) * A_p

are unbiased for ``N`` and ``A`` whenever ``pi_p > 0`` on every page with ``A_p > 0`` (the importance
sampling identity behind eq. 7 and appendix C eqs. 13-14, applied to the page sums: each draw ``P``
contributes ``N_P / pi_P``, whose mean under ``pi`` is ``sum_p N_p``; the support condition is the
paper's ``supp(pi) >= supp(p_n)`` with pages as the sampled values). Both are means of ``m`` i.i.d.
terms, so by the strong law of large numbers they converge almost surely to ``N`` and ``A`` as
``m -> inf``, and ``o_hat = (N_hat + R_v) / (A_hat + R_a)`` converges to ``o`` (continuous mapping; the
denominator is positive): the SNIS ratio is consistent, with the usual ``O(1/m)`` bias of a ratio
estimator, exactly as for tokens. In attention form, giving every token ``i`` of page ``p`` the logit
bias ``b_i = log c_p - log m - log pi_p`` multiplies its ``a_i`` by ``c_p / (m pi_p)``, so the softmax
over the biased logits computes ``o_hat``; undrawn pages (``c_p = 0``) get weight 0 and are evicted. The
temperature of eq. 10 divides this bias by ``tau`` (weights ``(c_p / (m pi_p)) ** (1 / tau)``), trading
bias for variance as for tokens; all tokens of a page share one bias.

Page proposal. ``pi_p = sum_{i in p} pi_i`` (the token proposal summed over the page), so a page has
positive mass whenever one of its tokens has. The variance of ``N_hat`` is that of importance sampling
over page sums, minimal for ``pi_p ~ ||N_p||`` (the minimum-variance proposal of appendix H with pages
as the sampled values); summing the ``min`` proposal ``pi_i ~ a_i ||v_i||`` over a page gives
``sum_{i in p} a_i ||v_i|| >= ||N_p||``, its natural page version.

Budget (appendix F: Algorithm 2, eq. 24; F.1, eq. 33 for the global budget). The expected number of
distinct pages after ``m`` draws is ``E[J(m)] = sum_p (1 - (1 - pi_p) ** m)``; the search of
:func:`presses.probabilistic.budget.search_num_samples` runs unchanged on the page proposal, with the target
``j*_pages = (1 - r) T / B`` pages (:func:`page_target`) and the tolerance ``0.5 / B`` pages
(:func:`page_tolerance`). With full pages the expected kept token count is ``B E[J(m)]``, so the
criterion ``|E[J(m)] - j*_pages| <= 0.5 / B`` is the token unit's ``|E[kept] - (1 - r) T| <= 0.5``
tokens; a partial last page of ``n < B`` tokens lowers the expected kept count by
``(B - n) P(last page drawn) < B``. One more draw adds at most one page to ``E[J]`` (eq. 31), so the
tolerance may be unreachable for a few large pages; Algorithm 2 then returns the smallest ``m`` it
could not rule out, whose ``E[J]`` exceeds the target by less than one page. The target is the
unfloored ``(1 - r) T / B`` rather than ``floor(T (1 - r))`` rounded to whole pages, and the
tolerance is in tokens rather than the paper's 0.5 entries, because the token unit targets the
unfloored ``(1 - r) t`` within 0.5 tokens: with ``B = 1`` the two units then make the same search,
the same ``m``, the same draws and the same bias (an expected-count budget needs no integer target).

Storage. As for tokens, each layer is stored dense and padded to its largest per-group kept count
(padding gets the bias ``-inf``). Kept counts move in steps of a page, so they differ more between the
groups of a layer than with tokens and the padding costs more: the physical compression is lower
than the logical one (``ProbabilisticEvictionPress.summary()`` reports both).

Shapes: ``T`` prompt positions, ``B`` page size, ``P = ceil(T / B)`` pages.
"""

from __future__ import annotations

import torch

from presses.core.paging import check_compression_ratio, expand_pages, page_scores

__all__ = ["UNITS", "page_proposal", "page_target", "page_tolerance", "expand_pages"]

UNITS = ("token", "page")


def page_proposal(pi: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page proposal ``pi_p = sum_{i in page p} pi_i`` (the token proposal summed over each page).

    Page ``p`` holds positions ``[p B, (p + 1) B)``; a partial last page sums only its existing
    positions. With ``page_size = 1`` the result equals ``pi`` bit for bit (float32).

    Args:
        pi: ``(..., T)`` token proposal (rows summing to 1).
        page_size: ``B >= 1`` tokens per page.

    Returns:
        ``(..., P)`` float32 page proposal, ``P = ceil(T / B)``, rows summing to 1 up to rounding.

    Raises:
        ValueError: if ``page_size < 1``.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    return page_scores(pi, page_size, "mass")


def page_target(seq_len: int, compression_ratio: float, page_size: int) -> float:
    """Budget target in pages, ``j*_pages = (1 - r) T / B`` (see the module docstring for the choice).

    Computed as ``(1 - r) * T / B`` so that ``B = 1`` gives exactly the token unit's ``(1 - r) t`` of
    :func:`presses.probabilistic.budget.search_num_samples`.

    Args:
        seq_len: ``T >= 0`` prompt positions.
        compression_ratio: ``r`` in ``[0, 1)``.
        page_size: ``B >= 1``.

    Returns:
        The (fractional) expected number of distinct pages to keep, in ``(0, ceil(T / B)]`` for ``T > 0``.

    Raises:
        ValueError: for ``compression_ratio`` outside ``[0, 1)``, ``seq_len < 0`` or ``page_size < 1``.
    """
    check_compression_ratio(compression_ratio)
    if seq_len < 0:
        raise ValueError(f"seq_len={seq_len} must be >= 0")
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    return (1.0 - compression_ratio) * seq_len / page_size


def page_tolerance(page_size: int, tol_tokens: float = 0.5) -> float:
    """Tolerance of the page budget search in pages, ``tol_tokens / B``: the token unit's tolerance
    (0.5 tokens, appendix F Algorithm 2) on the expected kept token count ``B E[J]`` of full pages.

    Args:
        page_size: ``B >= 1``.
        tol_tokens: tolerance in tokens, ``>= 0``.

    Returns:
        ``tol_tokens / B``; exactly ``tol_tokens`` for ``B = 1``.

    Raises:
        ValueError: if ``page_size < 1`` or ``tol_tokens < 0``.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    if tol_tokens < 0:
        raise ValueError(f"tol_tokens={tol_tokens} must be >= 0")
    return tol_tokens / page_size
