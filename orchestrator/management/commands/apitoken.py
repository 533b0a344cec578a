from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from orchestrator.auth import token_issue


class Command(BaseCommand):
    help = "Print a new API bearer token for USERNAME (its last line is the token)."

    def add_arguments(self, parser):
        parser.add_argument("username")

    def handle(self, *args, username, **options):
        User = get_user_model()
        try:
            user = User.objects.get(username=username)
        except User.DoesNotExist:
            raise CommandError(f"No user named {username!r}; create one with `manage.py createsuperuser` or the admin.")
        token = token_issue(user=user)
        self.stdout.write(f"Token for {username} (shown once; send it as 'Authorization: Bearer <token>'):")
        self.stdout.write(token)
