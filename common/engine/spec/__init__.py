"""Speculative decoding (`--speculative-algorithm`, docs/speculative.md): a drafter proposes up to k tokens per
running request, the target scores the last token and the drafts in one EXTEND forward, and each request
keeps the longest prefix of drafts the target itself would have produced, plus the target's next token.

    drafter.py      the one interface (propose k tokens per request; follow a target forward) and its factory
    ngram.py        NGRAM: drafts from the request's own tokens
    draft_model.py  STANDALONE: a small model whose KV lives in extra layers of the target's pages
    head_drafter.py NEXTN's MTP layer or an EAGLE head, fed the target's hidden states (its KV: one more layer)
    plan.py         which requests get how many drafts, their slots, the verify plan (DecodeBatch asks it)
    verify.py       the verify forward's rows, the per-position sampling rows, acceptance
    commit.py       the accepted tokens into the request, the rejected slots freed, the metrics
"""
