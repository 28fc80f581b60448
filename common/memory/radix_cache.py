"""Page-aligned radix tree over token ids whose nodes own KV pages; LRU eviction of unlocked leaves.

A node's key is a run of token ids (a multiple of page_size long); its value holds their KV slots.
Children are keyed by their first page of token ids. lock_ref > 0 on a node means some running
request uses its pages (inc/dec walk the whole path to the root). A `CacheListener` (KV cache events) hears
of every page stored, evicted or cleared. `on_evict(node)`, when set, sees each leaf just before its pages
are freed (the host tier copies them out: common.memory.hicache).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import torch

from common.memory.allocator import PagedAllocator
from common.memory.cache_listener import DEVICE_MEDIUM, CacheListener
from common.memory.errors import MemoryIntegrityError
from common.memory.prefix_cache import MatchResult, PrefixCache


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    def path(self) -> list[TreeNode]:
        """The nodes from the root's child down to this one (the root itself excluded)."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


class RadixCache(PrefixCache):
    def __init__(
        self,
        allocator: PagedAllocator,
        page_size: int,
        listener: CacheListener | None = None,
        medium: str = DEVICE_MEDIUM,
    ):
        """`medium`: the tier this tree's pages are in, as `listener` reports it."""
        self.allocator = allocator
        self.page_size = page_size
        self.listener, self.medium = listener, medium
        self._clock = itertools.count(1)
        self.on_evict: Callable[[TreeNode], None] | None = None
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64), None)
        self.root.lock_ref = 1
        self._evictable = 0
        self._locked = 0
        if self.listener is not None:
            self.listener.cleared()

    # -- lookup ----------------------------------------------------------------------------------
    def _page(self, key: list[int], pos: int) -> tuple[int, ...]:
        return tuple(key[pos : pos + self.page_size])

    def _common_len(self, a: list[int], b: list[int]) -> int:
        """Common prefix length of a and b, rounded down to whole pages."""
        n, ps, i = min(len(a), len(b)), self.page_size, 0
        while i + ps <= n and a[i : i + ps] == b[i : i + ps]:
            i += ps
        return i

    def _touch(self, node: TreeNode) -> None:
        node.last_access = next(self._clock)

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        key = token_ids[: len(token_ids) // self.page_size * self.page_size]
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._page(key, pos))
            if child is None:
                break
            self._touch(child)
            m = self._common_len(child.key, key[pos:])
            if m < len(child.key):
                child = self._split(child, m)
            values.append(child.value)
            node, pos = child, pos + m
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots, node)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut child after m tokens; the new upper node inherits its lock and access time."""
        upper = TreeNode(child.key[:m], child.value[:m], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self._page(upper.key, 0)] = upper
        child.key, child.value, child.parent = child.key[m:], child.value[m:], upper
        upper.children[self._page(child.key, 0)] = child
        return upper

    # -- insert ----------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Insert the page-aligned head; returns how many leading tokens were cached already."""
        already, _ = self._insert(token_ids, slots)
        return already

    def _insert(self, token_ids: list[int], slots: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
        n = len(token_ids) // self.page_size * self.page_size
        key, node, pos, duplicates = token_ids[:n], self.root, 0, []
        while pos < n:
            child = node.children.get(self._page(key, pos))
            if child is None:
                new = TreeNode(key[pos:], slots[pos:n].clone(), node)
                self._touch(new)
                node.children[self._page(key, pos)] = new
                self._evictable += (n - pos) // self.page_size
                if self.listener is not None:
                    self.listener.stored(key, pos, self.medium)
                return pos, duplicates
            self._touch(child)
            m = self._common_len(child.key, key[pos:])
            if m < len(child.key):
                child = self._split(child, m)
            mine = slots[pos : pos + m]
            duplicates.append(mine[mine != child.value])
            node, pos = child, pos + m
        return n, duplicates

    # -- locks -----------------------------------------------------------------------------------
    def inc_lock_ref(self, node: Any) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_size
                self._evictable -= pages
                self._locked += pages
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Any) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise MemoryIntegrityError("dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_size
                self._evictable += pages
                self._locked -= pages
            node = node.parent

    # -- a request hands its KV over -------------------------------------------------------------
    # A finished (or aborted, or retracted) request's slots, by token index:
    #   [0, cached_len)       tree pages it matched and locked     -> unlocked here (dec_lock_ref)
    #   [cached_len, n)       its own pages, n = len rounded down  -> inserted; where the tree already
    #                                                                had those tokens, its copies are freed
    #   [n, len)              its partial tail page                -> freed here
    def cache_finished_req(self, token_ids: list[int], slots: torch.Tensor, last_node: Any) -> None:
        n = len(token_ids) // self.page_size * self.page_size
        _, duplicates = self._insert(token_ids[:n], slots[:n])
        for dup in duplicates:
            self.allocator.free_slots(dup)
        self.allocator.free_slots(slots[n:])
        self.dec_lock_ref(last_node)

    # -- eviction --------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_pages:
            _, _, node = heapq.heappop(leaves)
            if self.on_evict is not None:
                self.on_evict(node)
            self.allocator.free_slots(node.value)
            if self.listener is not None:
                self.listener.removed(*self._path_tokens(node), self.medium)
            pages = len(node.key) // self.page_size
            freed += pages
            self._evictable -= pages
            parent = node.parent
            del parent.children[self._page(node.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _path_tokens(self, node: TreeNode) -> tuple[list[int], int]:
        """(the tokens from the root to the end of node, where node's own begin)."""
        tokens = [t for n in node.path() for t in n.key]
        return tokens, len(tokens) - len(node.key)

    def evictable_pages(self) -> int:
        return self._evictable

    def locked_pages(self) -> int:
        return self._locked

    # -- checks ----------------------------------------------------------------------------------
    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        evictable = locked = 0
        seen: set[int] = set()
        for node in self._nodes():
            if len(node.key) != len(node.value) or len(node.key) % self.page_size or not node.key:
                raise MemoryIntegrityError(f"node with {len(node.key)} tokens and {len(node.value)} slots")
            if node.lock_ref < 0 or (node.parent is not self.root and node.parent.lock_ref < node.lock_ref):
                raise MemoryIntegrityError("a node is locked more than its parent")
            pages = self.allocator.pages_of(node.value)
            if any(self.allocator.is_free(p) for p in pages) or seen.intersection(pages):
                raise MemoryIntegrityError("a cached page is also free, or cached twice")
            seen.update(pages)
            if node.lock_ref:
                locked += len(pages)
            else:
                evictable += len(pages)
        if (evictable, locked) != (self._evictable, self._locked):
            raise MemoryIntegrityError(
                f"counters say {self._evictable} evictable / {self._locked} locked, the tree has {evictable} / {locked}"
            )
