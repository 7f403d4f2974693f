import sys


def count_words(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split(" "):
                word = word.lower()
                counts[word] = counts[word] + 1
    return counts


if __name__ == "__main__":
    for word, n in sorted(count_words(sys.argv[1]).items()):
        print(word, n)
