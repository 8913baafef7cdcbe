def add_parser(commands):
    commands.add_parser("bench", help="(coming)")


def run(args):
    return 0
