from django.core.management.base import BaseCommand

from orchestrator import conf


class Command(BaseCommand):
    help = ("Print the markdown table of every ORCH_* setting, generated from orchestrator/conf.py (TABLE); "
            "--write puts it into docs/configuration.md between its conf.TABLE markers.")
    requires_system_checks = []  # documents the settings whatever their values

    def add_arguments(self, parser):
        parser.add_argument("--write", action="store_true",
                            help="replace the table between the markers of docs/configuration.md")

    def handle(self, *args, write: bool = False, **options):
        if not write:
            self.stdout.write(conf.markdown_table(), ending="")
            return
        page = conf.DOCS_PAGE.read_text()
        updated = conf.with_generated_table(page)
        if updated == page:
            self.stdout.write(f"{conf.DOCS_PAGE.relative_to(conf.BASE_DIR)}: up to date ({len(conf.TABLE)} settings)")
            return
        conf.DOCS_PAGE.write_text(updated)
        self.stdout.write(f"{conf.DOCS_PAGE.relative_to(conf.BASE_DIR)}: table rewritten ({len(conf.TABLE)} settings)")
