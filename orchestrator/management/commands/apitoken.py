from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from orchestrator.auth import token_issue


class Command(BaseCommand):
    help = "Print a new API bearer token for USERNAME (its last line is the token)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--expires-in-days", type=float, default=None, metavar="N",
                            help="the token stops working N days from now (default: it never expires)")

    def handle(self, *args, username, expires_in_days=None, **options):
        if expires_in_days is not None and expires_in_days <= 0:
            raise CommandError("--expires-in-days must be a positive number of days.")
        User = get_user_model()
        try:
            user = User.objects.get(username=username)
        except User.DoesNotExist:
            raise CommandError(f"No user named {username!r}; create one with `manage.py createsuperuser` or the admin.")
        token = token_issue(user=user, expires_in_days=expires_in_days)
        expiry = f", expires in {expires_in_days:g} days" if expires_in_days is not None else ""
        self.stdout.write(f"Token for {username} (shown once{expiry}; send it as 'Authorization: Bearer <token>'):")
        self.stdout.write(token)
