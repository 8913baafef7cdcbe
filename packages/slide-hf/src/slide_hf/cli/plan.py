def add_parser(commands):
    commands.add_parser("plan", help="(coming)")


def run(args):
    return 0
