"""Binomial checkpointing (Griewank & Walther's revolve): the uniform chain, solved exactly.

The chain: l equal steps x_0 -> x_1 -> ... -> x_l. Reversing step i (running its backward)
needs only its input x_i. Memory is counted in slots of one state, s of them, and the chain's
input x_0 sits in one from the start. Three things are free, as in revolve: the state in hand
(the one just computed), the single step being reversed, and its record. Each forward costs 1.

    advance   run steps forward from a state (each step run costs 1 forward step)
    store     put the state in hand into a free slot (a checkpoint)
    restore   take a stored state back in hand (it stays stored)
    reverse   record step i's forward from x_i (in hand) and run its backward; a slot that
              held x_i is free again: nothing below step i needs it

The least number of forward steps P(n, m) to reverse n steps whose input is stored, with m slots in all (that input's
included), follows from the first decision: advance k steps (1 <= k < n) from the stored input, reverse the upper n - k
steps from x_k, then reverse the lower k steps from the input again (it is still stored, every slot free but its own):

    P(1, m) = 0                                    (reverse the step from its stored input)
    P(n, m) = min over k of  k + Q(n - k, m - 1) + P(k, m)
    Q(1, m') = 0                                   (x_k in hand is reversed at once, no slot)
    Q(n', m') = P(n', m')  if m' >= 1 else no way  (x_k needs a slot of its own)

With one slot this is n(n-1)/2 (advance from x_0 again for every step). Griewank & Walther
(2000) count the schedules: with s slots and every step advanced at most t times, at most
beta(s, t) = C(s + t, s) steps can be reversed, and the least total is

    t*l - C(s + t, t - 1)     with t = min{t : C(s + t, s) >= l}

which the table matches for every l and s (tests/test_planner.py checks l <= 200, s <= 10). The same recurrence, with
the bytes of each layer in place of one slot, is picockpt's planner (picockpt/planning/planner.py).

    plan = plan_uniform(10, 3)        # plan.forward_steps == 15, plan.actions: what to do, in order

The table costs about length^2 x slots operations (slots beyond length change nothing): past
MAX_WORK, about a second, plan_uniform refuses and gives the closed form's count instead.
"""
import functools
import math
from dataclasses import dataclass

import numpy as np


def binomial_forward_steps(length, slots):
    """Griewank & Walther's closed form: (least forward steps, t) for `length` steps, `slots` slots."""
    _check(length, slots)
    t = 0
    while math.comb(slots + t, slots) < length:
        t += 1
    below = math.comb(slots + t, t - 1) if t >= 1 else 0  # C(n, -1) = 0: one step needs no advance
    return t * length - below, t


@functools.lru_cache(maxsize=8)
def forward_steps_table(length, slots):
    """P[n, m] for n = 0..length steps and m = 0..slots slots (inf where impossible)."""
    P = np.full((length + 1, slots + 1), np.inf)  # (n, m)
    P[1, 1:] = 0.0
    for m in range(1, slots + 1):
        for n in range(2, length + 1):
            k = np.arange(1, n)  # (n-1,) steps advanced before the first checkpoint
            upper = P[n - k, m - 1] if m > 1 else np.full(n - 1, np.inf)  # (n-1,) x_k stored
            upper = np.where(n - k == 1, 0.0, upper)  # (n-1,) one step left: reversed from hand
            P[n, m] = np.min(k + upper + P[k, m])
    return P


@dataclass(frozen=True)
class UniformPlan:
    length: int
    slots: int
    forward_steps: int       # forward advances, not counting each step's recording forward
    actions: tuple           # ({"action": ..., ...}, ...) in the order they run

    def lines(self):
        return [describe(action) for action in self.actions]


def plan_uniform(length, slots):
    """The optimal schedule for the uniform chain of `length` steps with `slots` slots."""
    _check(length, slots)
    _check_size(length, slots)
    P = forward_steps_table(length, min(slots, length))  # more slots than steps: the extra ones stay empty
    actions = [{"action": "store", "state": 0, "slot": 1}]
    _unroll(P, length, min(slots, length), actions)
    return UniformPlan(length, slots, int(P[length, min(slots, length)]), tuple(actions))


def _unroll(P, length, slots, actions):
    """Append the actions that reverse steps 0..length-1 from the stored x0, in the order they run.
    Each task (first, n, m, in_hand) reverses steps first..first+n-1 from the stored x_first with m
    slots; a stack of tasks, not recursion, so that long chains do not exhaust Python's stack."""
    used = {0: 1}  # state -> slot number
    tasks = [(0, length, slots, 0)]  # the last one runs next
    while tasks:
        first, n, m, in_hand = tasks.pop()
        if in_hand != first:
            actions.append({"action": "restore", "state": first, "slot": used[first]})
        if n == 1:
            actions.append({"action": "reverse", "step": first})
            slot = used.pop(first, None)
            if slot is not None:
                actions[-1]["frees_slot"] = slot
            continue
        k = np.arange(1, n)  # (n-1,) the choices, as in forward_steps_table
        upper = P[n - k, m - 1] if m > 1 else np.full(n - 1, np.inf)  # (n-1,)
        k = int(np.argmin(k + np.where(n - k == 1, 0.0, upper) + P[k, m])) + 1  # the first cheapest
        actions.append({"action": "advance", "from": first, "to": first + k})
        tasks.append((first, k, m, None))  # then the lower k steps, from x_first again
        if n - k == 1:  # the last step: reversed straight from the state in hand
            actions.append({"action": "reverse", "step": first + k})
        else:  # first the upper n - k steps, from x_{first+k} stored in a free slot
            slot = min(set(range(1, len(used) + 2)) - set(used.values()))
            used[first + k] = slot
            actions.append({"action": "store", "state": first + k, "slot": slot})
            tasks.append((first + k, n - k, m - 1, first + k))


def describe(action):
    kind = action["action"]
    if kind == "store":
        return f"store x{action['state']} in slot {action['slot']}"
    if kind == "restore":
        return f"restore x{action['state']} from slot {action['slot']}"
    if kind == "advance":
        first, last = action["from"], action["to"]
        return f"advance x{first} -> x{last} ({last - first} forward step{'s' if last - first > 1 else ''})"
    freed = f", slot {action['frees_slot']} is free" if "frees_slot" in action else ""
    return f"reverse step {action['step']} (record its forward from x{action['step']}, then backward){freed}"


MAX_WORK = 4 * 10**8  # length**2 * slots: about a second to plan on one CPU core


def _check_size(length, slots):
    """The table has (length + 1) x (slots + 1) entries and each costs up to `length` operations:
    refuse, with the closed form's answer, a chain that would take minutes to plan."""
    work = length**2 * min(slots, length)
    if work > MAX_WORK:
        steps, t = binomial_forward_steps(length, slots)
        raise ValueError(f"length={length}, slots={slots}: the optimal schedule comes from a table of every sub-chain "
                         f"and slot count, length^2 x slots = {work:,} operations, more than the {MAX_WORK:,} planned "
                         f"here (about a second; this one would take {work / MAX_WORK:,.2f}x as long). Use a shorter "
                         f"chain or fewer slots; the least number of forward steps, from the closed form alone, is "
                         f"{steps:,} (t = {t})")


def _check(length, slots):
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r}: the chain needs a whole number of steps >= 1")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots={slots!r}: at least 1 slot is needed (the chain's input x0 occupies one)")
