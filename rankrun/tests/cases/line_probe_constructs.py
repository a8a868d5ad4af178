"""Every construct rankrun.line_probes handles (rankrun/tests/test_line_probes.py): run and not
run, raised and caught, defined and never called."""
from __future__ import annotations

import functools
import sys
import traceback


def deco(f):
    return f


def raising_deco():
    raise KeyError("at definition")


@deco
@functools.lru_cache(maxsize=None)
def decorated(x):
    """A docstring."""
    return x + 1


class Base:
    """A class docstring."""
    attribute = 1

    @staticmethod
    def static():
        return 2

    def method(self):
        return super().__init__()


@deco
class Decorated(Base):
    pass


def branches(x):
    if x == 0:
        return "zero"
    elif x == 1:
        return "one"
    elif (x ==
          2):
        return "two"
    else:
        return "many"


def loops(n):
    total = 0
    for i in range(n):
        if i % 2:
            continue
        total += i
    else:
        total += 100
    while n > 0:
        n -= 1
        if n == 1:
            break
    else:
        total += 1000
    return total


def handlers(kind):
    try:
        if kind == "key":
            raise KeyError(kind)
        if kind == "value":
            raise ValueError(kind)
        if kind == "type":
            raise TypeError(kind)
    except KeyError:
        result = "key"
    except (ValueError,
            IndexError) as error:
        result = f"value {error}"
    except ZeroDivisionError:
        result = "never"
    else:
        result = "none"
    finally:
        done = True
    return result, done


def bare(kind):
    try:
        if kind:
            raise RuntimeError
    except:  # noqa: E722
        return "bare"
    return "fine"


def unmatched():
    try:
        try:
            raise LookupError("outer")
        except OSError:
            pass
    except LookupError:
        return "outer caught"


def generator(n):
    for i in range(n):
        yield i


def comprehension(n):
    values = [i
              for i in range(n)
              if i]
    mapping = {i: (lambda y:
                   y * 2)(i) for i in values}
    return mapping


def with_block():
    import contextlib
    with contextlib.suppress(ZeroDivisionError):
        x = 1 / 0
        return x
    return "suppressed"


def early(x):
    if x:
        return 1
    y = 2; z = 3
    return y + z


def never_called():
    return "dead"


def define_raising():
    @raising_deco()
    def inner():
        return 1
    return inner


def fails_in_the_middle_of_a_line(values):
    return values["present"] + values[
        "absent"]


def main():
    print(decorated(1), Decorated().method(), Base.static())
    print([branches(i) for i in (0, 1, 2)])
    print(loops(4), handlers("key"), handlers("value"), handlers("none"))
    print(bare(True), bare(False), unmatched())
    print(list(generator(3)), comprehension(3), with_block(), early(1))
    try:
        define_raising()
    except KeyError:
        pass
    x = 1 if sys else 2
    assert x == 1
    global GLOBAL
    GLOBAL = 1
    try:
        fails_in_the_middle_of_a_line({"present": 1})
    except KeyError:
        traceback.print_exc(file=sys.stdout)  # the same lines, columns and source with probes


if __name__ == "__main__":
    main()
