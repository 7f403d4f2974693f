import json
from datetime import datetime


def load(path):
    with open(path) as f:
        return json.load(f)


def days_employed(employee, today="2026-01-01"):
    start = datetime.strptime(employee["start"], "%d-%m-%Y")
    return (datetime.strptime(today, "%Y-%m-%d") - start).days


def longest_serving(path):
    emps = load(path)
    return max(emps, key=days_employed)["name"]


if __name__ == "__main__":
    print(longest_serving("employees.json"))
