"""Small statistics helpers."""


def mean(xs):
    return sum(xs) / len(xs)


def median(xs):
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid]


def mode(xs):
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    return max(counts)


if __name__ == "__main__":
    data = [3, 1, 4, 1, 5, 9, 2, 6]
    print(mean(data), median(data), mode(data))
