STOCK = {"apple": 5, "pear": 0}


def restock(item, amount):
    STOCK[item] += amount
    return STOCK[item]


def sell(item, amount):
    if STOCK[item] > amount:
        STOCK[item] -= amount
        return True
    return False
