def parse_prices(lines):
    prices = {}
    for line in lines:
        name, price = line.split("=")
        prices[name.strip()] = float(price)
    return prices


def total(prices, basket):
    return sum(prices[item] * qty for item, qty in basket.items())


if __name__ == "__main__":
    text = open("prices.txt").read().splitlines()
    print(round(total(parse_prices(text), {"tea": 2, "milk": 1}), 2))
